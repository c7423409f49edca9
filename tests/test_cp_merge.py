"""Exact log-sum-exp merge of attention partials, and attention with lse (docs/context_parallel.md, "Exact merge"; docs/platform.md)."""

import pytest
import torch

from cpllm.context_parallel.merge import merge_attention_partials, merge_two
from cpllm.context_parallel.sdpa import attention_with_lse, causal_offset_mask, reference_attention

NEG_INF = float("-inf")


def qkv(batch=2, hq=6, hkv=2, q_len=5, k_len=11, dim=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, hq, q_len, dim, generator=g).to(dtype)
    k = torch.randn(batch, hkv, k_len, dim, generator=g).to(dtype)
    v = torch.randn(batch, hkv, k_len, dim, generator=g).to(dtype)
    return q, k, v


def partials_over(q, k, v, subsets, scale, q_pos=None, k_pos=None):
    """Attention of q to each key subset; returns outs [S, B, L, H, D], lses [S, B, L, H]."""
    outs, lses = [], []
    for idx in subsets:
        idx = torch.as_tensor(idx, dtype=torch.long)
        mask = None
        if q_pos is not None:
            mask = causal_offset_mask(q_pos, k_pos[idx], q.dtype)
        o, lse = attention_with_lse(q, k[:, :, idx], v[:, :, idx], scale=scale, mask=mask)
        outs.append(o.transpose(1, 2))
        lses.append(lse.transpose(1, 2))
    return torch.stack(outs), torch.stack(lses)


def random_subsets(k_len, n, gen):
    labels = torch.randint(0, n, (k_len,), generator=gen)
    return [torch.nonzero(labels == s).flatten().tolist() for s in range(n)]


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_merge_random_subsets_equals_full_attention(n):
    q, k, v = qkv(k_len=13, seed=n)
    gen = torch.Generator().manual_seed(100 + n)
    ref_out, ref_lse = reference_attention(q, k, v, scale=0.25)
    for trial in range(4):
        subsets = random_subsets(13, n, gen)
        if trial == 0:
            subsets = subsets + [[]]  # an explicitly empty shard
        outs, lses = partials_over(q, k, v, subsets, 0.25)
        out, lse = merge_attention_partials(outs, lses)
        assert out.dtype == torch.float32 and lse.dtype == torch.float32
        assert (out.transpose(1, 2).double() - ref_out).abs().max() <= 1e-5
        assert (lse.transpose(1, 2).double() - ref_lse).abs().max() <= 1e-5


@pytest.mark.parametrize("n,interleave", [(2, 1), (3, 2), (4, 3)])
def test_merge_interleaved_shards_with_causal_positions(n, interleave):
    # KV sharded like the CP cache (runs of `interleave` tokens round robin) and
    # queries at absolute positions: some shards see no key for early queries.
    k_len, q_len = 17, 6
    q, k, v = qkv(q_len=q_len, k_len=k_len, seed=7)
    k_pos = torch.arange(k_len)
    q_pos = torch.arange(k_len - q_len - 3, k_len - 3)  # first query sees 9 keys
    q_pos[0] = 0  # and one that sees only key 0: all shards but rank 0 empty
    subsets = [[p for p in range(k_len) if (p // interleave) % n == r] for r in range(n)]
    outs, lses = partials_over(q, k, v, subsets, 0.3, q_pos=q_pos, k_pos=k_pos)
    assert torch.isneginf(lses[1:, :, 0]).all()
    out, lse = merge_attention_partials(outs, lses)
    full_mask = causal_offset_mask(q_pos, k_pos, torch.float64)
    ref_out, ref_lse = reference_attention(q, k, v, scale=0.3, mask=full_mask)
    assert (out.transpose(1, 2).double() - ref_out).abs().max() <= 1e-5
    assert (lse.transpose(1, 2).double() - ref_lse).abs().max() <= 1e-5


def test_merge_all_empty_rows_no_nan():
    outs = torch.randn(3, 2, 4, 8)
    outs[:, 0, 1] = float("nan")  # garbage output of empty shards must not leak
    lses = torch.randn(3, 2, 4)
    lses[:, 0, 1] = NEG_INF  # row empty on every shard
    lses[1, 1, 2] = NEG_INF  # one shard empty
    out, lse = merge_attention_partials(outs, lses)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.isneginf(lse[0, 1]) and (out[0, 1] == 0).all()
    w = torch.softmax(lses[[0, 2], 1, 2], dim=0)
    assert torch.allclose(out[1, 2], w[0] * outs[0, 1, 2] + w[1] * outs[2, 1, 2], atol=1e-6)


def test_merge_large_lse_does_not_overflow():
    outs = torch.randn(2, 3, 4)
    lses = torch.tensor([[1000.0, -1000.0, 5.0], [1000.0 + torch.log(torch.tensor(3.0)).item(), -999.0, 5.0]])
    out, lse = merge_attention_partials(outs, lses)
    assert torch.isfinite(out).all()
    assert torch.allclose(out[0], 0.25 * outs[0, 0] + 0.75 * outs[1, 0], atol=1e-5)
    assert abs(lse[0].item() - (1000.0 + torch.log(torch.tensor(4.0)).item())) < 1e-3


def test_merge_two_matches_stack():
    outs = torch.randn(2, 3, 5, 8)
    lses = torch.randn(2, 3, 5)
    a = merge_two(outs[0], lses[0], outs[1], lses[1])
    b = merge_attention_partials(outs, lses)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_accumulate_in_place_matches_merge_two():
    """The prefill accumulator: rows start empty (0, -inf), take partials in place, and equal merge_two's result;
    a slice updates the view, an index tensor writes back."""
    from cpllm.context_parallel.merge import accumulate

    g = torch.Generator().manual_seed(3)
    parts = [(torch.randn(4, 3, 8, generator=g), torch.randn(4, 3, generator=g) * 5) for _ in range(3)]
    for rows in (slice(2, 6), torch.tensor([5, 1, 7, 3])):
        out, lse = torch.zeros(8, 3, 8), torch.full((8, 3), float("-inf"))
        want_o, want_l = torch.zeros(4, 3, 8), torch.full((4, 3), float("-inf"))
        for o_part, l_part in parts:
            accumulate(out, lse, rows, o_part, l_part)
            want_o, want_l = merge_two(want_o, want_l, o_part, l_part)
        assert torch.allclose(out[rows], want_o, atol=1e-5) and torch.allclose(lse[rows], want_l, atol=1e-5)
        untouched = torch.ones(8, dtype=torch.bool)
        untouched[rows] = False
        assert (out[untouched] == 0).all() and torch.isneginf(lse[untouched]).all()


def test_merge_bf16_inputs():
    q, k, v = qkv(k_len=20, dtype=torch.bfloat16, seed=3)
    subsets = [list(range(0, 20, 3)), list(range(1, 20, 3)), list(range(2, 20, 3))]
    outs, lses = partials_over(q, k, v, subsets, 0.25)
    assert outs.dtype == torch.bfloat16 and lses.dtype == torch.float32
    out, lse = merge_attention_partials(outs, lses)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    ref_out, ref_lse = reference_attention(q, k, v, scale=0.25)
    assert (out.transpose(1, 2).double() - ref_out).abs().max() <= 3e-2
    assert (lse.transpose(1, 2).double() - ref_lse).abs().max() <= 3e-2


def test_merge_shape_errors():
    with pytest.raises(ValueError, match="does not match"):
        merge_attention_partials(torch.zeros(2, 3, 4), torch.zeros(2, 4))


# --- attention_with_lse vs the float64 reference ------------------------------------------


def close(got, ref, tol=1e-5):
    out, lse = got
    ref_out, ref_lse = ref
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape and lse.dtype == torch.float32
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    fin = torch.isfinite(ref_lse)
    assert (lse[fin].double() - ref_lse[fin]).abs().max() <= tol
    assert (out.double() - ref_out).abs().max() <= tol


@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (9, 3), (4, 1)])
def test_sdpa_plain_and_gqa(hq, hkv):
    q, k, v = qkv(hq=hq, hkv=hkv, q_len=7, k_len=9)
    close(attention_with_lse(q, k, v, scale=0.2), reference_attention(q, k, v, scale=0.2))


@pytest.mark.parametrize("q_len,k_len", [(5, 5), (3, 8), (8, 3)])
def test_sdpa_causal_flag_top_left(q_len, k_len):
    q, k, v = qkv(q_len=q_len, k_len=k_len)
    got = attention_with_lse(q, k, v, scale=0.2, causal=True)
    close(got, reference_attention(q, k, v, scale=0.2, causal=True))
    # top-left: query i sees keys 0..i, the same as an offset mask with equal origins
    mask = causal_offset_mask(torch.arange(q_len), torch.arange(k_len), torch.float64)
    close(got, reference_attention(q, k, v, scale=0.2, mask=mask))


def test_sdpa_head_tail_chunk_with_offset_mask():
    # A PCP chunk [s, e) attends to keys [0, e) with the diagonal at s.
    s, e = 6, 10
    q, k, v = qkv(q_len=e - s, k_len=e)
    mask = causal_offset_mask(torch.arange(s, e), torch.arange(e), torch.float32)
    assert mask.shape == (e - s, e)
    got = attention_with_lse(q, k, v, scale=0.2, mask=mask)
    close(got, reference_attention(q, k, v, scale=0.2, mask=mask.double()))
    # the same thing as "keys before s" (no mask) merged with "the chunk itself" (square causal)
    o1, l1 = attention_with_lse(q, k[:, :, :s], v[:, :, :s], scale=0.2)
    o2, l2 = attention_with_lse(q, k[:, :, s:], v[:, :, s:], scale=0.2, causal=True)
    out, lse = merge_two(o1.transpose(1, 2), l1.transpose(1, 2), o2.transpose(1, 2), l2.transpose(1, 2))
    ref = reference_attention(q, k, v, scale=0.2, mask=mask.double())
    close((out.transpose(1, 2), lse.transpose(1, 2)), ref)


def test_sdpa_random_float_mask_broadcast_shapes():
    q, k, v = qkv(q_len=6, k_len=10)
    g = torch.Generator().manual_seed(1)
    mask = torch.randn(2, 1, 6, 10, generator=g)
    mask[torch.rand(2, 1, 6, 10, generator=g) < 0.3] = NEG_INF
    mask[..., 0] = 0.0  # keep every row non-empty here
    ref = reference_attention(q, k, v, scale=0.3, mask=mask.double())
    close(attention_with_lse(q, k, v, scale=0.3, mask=mask), ref)


def test_sdpa_fully_masked_rows_and_bool_mask():
    q, k, v = qkv(q_len=4, k_len=6)
    keep = torch.ones(4, 6, dtype=torch.bool)
    keep[1] = False  # no visible key
    keep[2, 3:] = False
    got = attention_with_lse(q, k, v, scale=0.3, mask=keep)
    assert torch.isneginf(got[1][:, :, 1]).all() and (got[0][:, :, 1] == 0).all()
    close(got, reference_attention(q, k, v, scale=0.3, mask=keep))
    # a key mask that hides key 0 combined with the top-left causal flag empties query row 0
    keep2 = torch.ones(4, 6, dtype=torch.bool)
    keep2[:, 0] = False
    got2 = attention_with_lse(q, k, v, scale=0.3, mask=keep2, causal=True)
    assert torch.isneginf(got2[1][:, :, 0]).all()
    close(got2, reference_attention(q, k, v, scale=0.3, mask=keep2, causal=True))


def test_sdpa_empty_keys_and_queries():
    q, k, v = qkv(q_len=3, k_len=0)
    out, lse = attention_with_lse(q, k, v, scale=0.3)
    assert out.shape == q.shape and (out == 0).all() and torch.isneginf(lse).all()
    q, k, v = qkv(q_len=0, k_len=4)
    out, lse = attention_with_lse(q, k, v, scale=0.3)
    assert out.shape == q.shape and lse.shape == (2, 6, 0)


def test_sdpa_bf16():
    q, k, v = qkv(q_len=5, k_len=9, dtype=torch.bfloat16)
    out, lse = attention_with_lse(q, k, v, scale=0.25)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    ref_out, ref_lse = reference_attention(q, k, v, scale=0.25)
    assert (out.double() - ref_out).abs().max() <= 2e-2
    assert (lse.double() - ref_lse).abs().max() <= 1e-3


def test_sdpa_shape_errors():
    q, k, v = qkv(hq=6, hkv=4)
    with pytest.raises(ValueError, match="multiple of KV heads 4"):
        attention_with_lse(q, k, v, scale=1.0)
