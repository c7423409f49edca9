"""The prefill attention kernel (cpllm/kernels/prefill_attention.c) against float64 attention, and where it steps
aside.

Engine and layout tests run it wherever it builds; these check the kernel alone: causal (top-left, as the flash
kernel's flag) and not, query counts that do not fill a tile of 64 rows, more queries than keys and fewer, grouped
queries (1, 3 and 4 heads per KV head), head sizes 32, 64 and 128, q read in place inside the fused q|k|v rows,
one and two threads, a causal offset (a run behind earlier keys, in one call); and that other dtypes and head sizes
go back to PyTorch's kernel. Each bf16 way the machine runs (AMX tiles, vdpbf16ps) is checked against float64
attention on the operands it rounds; a way that does not run here, or a head size it does not take, must be the
float32 kernel itself; the start-up choice between the ways is checked on given rates.
"""

from __future__ import annotations

import pytest
import torch

from cpllm.layers.gqa.local_attention import attend
from cpllm.context_parallel.sdpa import reference_attention
from cpllm.kernels import library
from cpllm.kernels.prefill_attention import BF16_WAYS, built_ways, has_bf16_products, pick_way, prefill_attention


def _kernel_runs() -> bool:
    """Built, and built with AVX-512 (without it the kernel declines every call)."""
    one = torch.ones(1, 1, 4)
    return library.load("prefill_attention") is not None and prefill_attention(one, one, one, 1.0, True) is not None


pytestmark = pytest.mark.skipif(not _kernel_runs(), reason="no C compiler or no AVX-512 on this machine")


def _qkv(length: int, keys: int, hq: int, hkv: int, d: int, seed: int = 0):
    """q as a view into fused q|k|v rows (as the model hands it over), k and v contiguous."""
    gen = torch.Generator().manual_seed(seed)
    fused = torch.randn(length, (hq + 2 * hkv) * d, generator=gen) * 2
    q = fused[:, : hq * d].view(length, hq, d)
    return q, torch.randn(keys, hkv, d, generator=gen) * 2, torch.randn(keys, hkv, d, generator=gen)


def _reference(q, k, v, scale, causal):
    out, lse = reference_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                   scale=scale, causal=causal)
    return out[0].transpose(0, 1), lse[0].transpose(0, 1)


@pytest.mark.parametrize("length, keys, hq, hkv, d, causal", [
    (1, 1, 4, 1, 64, True),
    (5, 5, 9, 3, 64, True),  # SmolLM2's grouping
    (130, 130, 16, 4, 64, True),  # rows past two tiles, keys past two blocks
    (70, 200, 16, 4, 64, False),  # queries against earlier context
    (200, 120, 4, 2, 64, True),  # more queries than keys: the last rows see every key
    (97, 97, 8, 8, 128, True),
    (33, 33, 6, 2, 32, True),
])
@pytest.mark.parametrize("threads", [1, 2])
def test_matches_float64_attention(length, keys, hq, hkv, d, causal, threads):
    q, k, v = _qkv(length, keys, hq, hkv, d)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, lse = prefill_attention(q, k, v, d**-0.5, causal)
    finally:
        torch.set_num_threads(previous)
    want_out, want_lse = _reference(q, k, v, d**-0.5, causal)
    torch.testing.assert_close(out.double(), want_out, rtol=0, atol=2e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=0, atol=2e-5)


def _offset_mask(length: int, keys: int, offset: int) -> torch.Tensor:
    return torch.arange(keys)[None, :] <= torch.arange(length)[:, None] + offset  # [L, S] keep-mask


def _skip_unless_built(way: str | None) -> None:
    if way is not None and way not in built_ways():
        pytest.skip(f"the {way} way does not run on this machine")


@pytest.mark.parametrize("length, offset", [(130, 70), (64, 1), (5, 200), (1, 9)])
@pytest.mark.parametrize("way", [None, *BF16_WAYS])
def test_causal_offset_is_a_run_behind_earlier_keys(length, offset, way):
    _skip_unless_built(way)
    bf16 = way is not None
    keys = length + offset
    q, k, v = _qkv(length, keys, 9, 3, 64, seed=5)
    out, lse = prefill_attention(q, k, v, 0.125, True, bf16_products=bf16, causal_offset=offset, bf16_way=way)
    operands = (_bf16(q * 0.125), _bf16(k), _bf16(v), 1.0) if bf16 else (q, k, v, 0.125)
    want_out, want_lse = reference_attention(*(t.transpose(0, 1)[None] for t in operands[:3]), scale=operands[3],
                                             mask=_offset_mask(length, keys, offset))
    atol = 2 ** -8 * float(v.abs().max()) if bf16 else 2e-5
    torch.testing.assert_close(out.double(), want_out[0].transpose(0, 1), rtol=0, atol=atol)
    torch.testing.assert_close(lse.double(), want_lse[0].transpose(0, 1), rtol=0, atol=1e-4 if bf16 else 2e-5)
    if not bf16:  # attend's fallback (float64: PyTorch's kernel with a keep-mask) takes the same offset
        fallback = attend(q.double(), k.double(), v.double(), 0.125, True, causal_offset=offset)
        torch.testing.assert_close(fallback[0], want_out[0].transpose(0, 1))
        torch.testing.assert_close(fallback[1].double(), want_lse[0].transpose(0, 1), rtol=0, atol=1e-5)


@pytest.mark.parametrize("runs", [((0, 70), (210, 70)), ((0, 1), (5, 64), (300, 33)), ((128, 64), (0, 64))])
@pytest.mark.parametrize("way", [None, *BF16_WAYS])
def test_per_query_offsets_are_runs_at_their_own_places(runs, way):
    """A PCP rank's head and tail chunks (new_start, length) of one prompt in one call: each query sees the keys up
    to its own position, as float64 attention under that mask, the rows of each run wherever they sit."""
    _skip_unless_built(way)
    bf16 = way is not None
    keys = max(start + length for start, length in runs)
    positions = torch.cat([torch.arange(start, start + length) for start, length in runs])
    offsets = positions - torch.arange(positions.numel())
    q, k, v = _qkv(positions.numel(), keys, 9, 3, 64, seed=6)
    out, lse = prefill_attention(q, k, v, 0.125, True, bf16_products=bf16, causal_offset=offsets, bf16_way=way)
    mask = torch.arange(keys)[None, :] <= positions[:, None]
    operands = (_bf16(q * 0.125), _bf16(k), _bf16(v), 1.0) if bf16 else (q, k, v, 0.125)
    want_out, want_lse = reference_attention(*(t.transpose(0, 1)[None] for t in operands[:3]), scale=operands[3],
                                             mask=mask)
    atol = 2 ** -8 * float(v.abs().max()) if bf16 else 2e-5
    torch.testing.assert_close(out.double(), want_out[0].transpose(0, 1), rtol=0, atol=atol)
    torch.testing.assert_close(lse.double(), want_lse[0].transpose(0, 1), rtol=0, atol=1e-4 if bf16 else 2e-5)
    if not bf16:  # attend's fallback takes the same per-query offsets
        fallback = attend(q.double(), k.double(), v.double(), 0.125, True, causal_offset=offsets)
        torch.testing.assert_close(fallback[0], want_out[0].transpose(0, 1))


def test_per_query_offsets_outside_the_keys_or_of_another_length_are_refused():
    q, k, v = _qkv(4, 6, 2, 1, 64)
    with pytest.raises(ValueError, match=r"reach keys \[0, 6\] outside \[0, 6\)"):
        prefill_attention(q, k, v, 0.1, True, causal_offset=torch.tensor([0, 0, 0, 3]))
    with pytest.raises(ValueError, match="wants one integer per query"):
        prefill_attention(q, k, v, 0.1, True, causal_offset=torch.zeros(3, dtype=torch.int64))


def test_causal_offset_outside_the_keys_is_refused():
    q, k, v = _qkv(4, 6, 2, 1, 64)
    with pytest.raises(ValueError, match="causal_offset 6 outside"):
        prefill_attention(q, k, v, 0.1, True, causal_offset=6)


def test_attend_takes_the_kernel_and_agrees_with_torch_flash():
    q, k, v = _qkv(80, 80, 9, 3, 64, seed=1)
    got = attend(q, k, v, 0.125, causal=True)
    flash_out, flash_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], 0.0, True, scale=0.125)
    torch.testing.assert_close(got[0], flash_out[0].transpose(0, 1), rtol=0, atol=1e-5)
    torch.testing.assert_close(got[1], flash_lse[0].transpose(0, 1), rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype, d", [(torch.bfloat16, 64), (torch.float64, 64), (torch.float32, 6),
                                      (torch.float32, 512)])
def test_other_inputs_go_to_torch(dtype, d):
    q, k, v = (t.to(dtype) for t in _qkv(4, 4, 2, 1, d))
    assert prefill_attention(q, k, v, 0.1, True) is None
    out, lse = attend(q, k, v, 0.1, causal=True)  # PyTorch's kernel, same contract
    assert out.shape == (4, 2, d) and lse.shape == (4, 2)


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.bfloat16().double()


@pytest.mark.parametrize("length, keys, hq, hkv, d, causal", [
    (1, 1, 4, 1, 64, True),
    (5, 5, 9, 3, 64, True),
    (130, 131, 16, 4, 64, False),  # an odd key count: the last value pair has no partner
    (200, 120, 4, 2, 64, True),
    (97, 97, 8, 8, 128, True),
    (300, 300, 9, 3, 64, True),  # keys past a block that fill no whole tile (AMX: the tail's padding)
    (33, 33, 6, 2, 36, True),  # a head size that is no multiple of 16 (masked conversions; AMX: float32)
])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("way", BF16_WAYS)
def test_bf16_products_are_attention_on_the_rounded_operands(length, keys, hq, hkv, d, causal, threads, way):
    _skip_unless_built(way)
    if way == "amx" and d % 32:
        pytest.skip("AMX tiles take head sizes that are multiples of 32 (test_amx_elsewhere_is_the_float32_kernel)")
    q, k, v = _qkv(length, keys, hq, hkv, d, seed=3)
    scale = d**-0.5
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, lse = prefill_attention(q, k, v, scale, causal, bf16_products=True, bf16_way=way)
    finally:
        torch.set_num_threads(previous)
    # q is scaled before rounding; scores, softmax and sums are float32, the probabilities rounded to bf16 once
    want_out, want_lse = _reference(_bf16(q * scale), _bf16(k), _bf16(v), 1.0, causal)
    assert out.dtype == lse.dtype == torch.float32
    torch.testing.assert_close(lse.double(), want_lse, rtol=0, atol=1e-4)
    torch.testing.assert_close(out.double(), want_out, rtol=0, atol=2 ** -8 * float(v.abs().max()))
    exact_out, _ = _reference(q, k, v, scale, causal)
    assert float((out.double() - exact_out).abs().max()) > 0  # it did round: this is not the float32 kernel


@pytest.mark.parametrize("boost", [(64, 6.0), (128, 0.2), (200, 30.0)])  # (first key scaled, by)
@pytest.mark.parametrize("way", BF16_WAYS)
def test_bf16_products_follow_a_max_that_jumps_or_falls_between_blocks(boost, way):
    """Keys from a later block on scaled up (their scores pass the running max by far more than the AMX way's lazy
    margin, so the output accumulated so far is rescaled) or down (the max never moves again)."""
    _skip_unless_built(way)
    first, by = boost
    q, k, v = _qkv(260, 260, 9, 3, 64, seed=8)
    k = k.clone()
    k[first:] *= by
    out, lse = prefill_attention(q, k, v, 0.125, True, bf16_products=True, bf16_way=way)
    want_out, want_lse = _reference(_bf16(q * 0.125), _bf16(k), _bf16(v), 1.0, True)
    torch.testing.assert_close(lse.double(), want_lse, rtol=0, atol=1e-4)
    torch.testing.assert_close(out.double(), want_out, rtol=0, atol=2 ** -8 * float(v.abs().max()))


@pytest.mark.parametrize("way", BF16_WAYS)
def test_bf16_products_with_scores_hundreds_apart_leave_the_callers_subnormals(way):
    """Every other key scaled by 300: rows' scores spread by hundreds, so many e^(s - m) fall under float32's
    smallest normal (the AMX way flushes them while its blocks run). The result is still attention on the rounded
    operands, and the calling thread keeps its subnormals afterwards."""
    _skip_unless_built(way)
    q, k, v = _qkv(300, 300, 9, 3, 64, seed=9)
    k = k.clone()
    k[::2] *= 300.0
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # the kernel runs on this thread
    try:
        out, lse = prefill_attention(q, k, v, 0.125, True, bf16_products=True, bf16_way=way)
        subnormal = float(torch.tensor([1e-39]) * 2.0)
    finally:
        torch.set_num_threads(previous)
    want_out, want_lse = _reference(_bf16(q * 0.125), _bf16(k), _bf16(v), 1.0, True)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-4)  # lse in the thousands: float32's ulp
    torch.testing.assert_close(out.double(), want_out, rtol=0, atol=2 ** -8 * float(v.abs().max()))
    assert subnormal > 0  # flush-to-zero would give 0


@pytest.mark.parametrize("way, d", [("amx", 36), ("amx", 64), ("avx512_bf16", 64)])
def test_amx_elsewhere_is_the_float32_kernel(way, d):
    """A way that does not run here, or AMX on a head size that is no multiple of 32, runs the float32 kernel."""
    if way in built_ways() and d % 32 == 0:
        pytest.skip(f"the {way} way runs here (test_bf16_products_are_attention_on_the_rounded_operands)")
    q, k, v = _qkv(70, 70, 6, 2, d, seed=4)
    fast, exact = (prefill_attention(q, k, v, d**-0.5, True, bf16_products=flag, bf16_way=way) for flag in (True, False))
    assert torch.equal(fast[0], exact[0]) and torch.equal(fast[1], exact[1])


def test_bf16_products_without_a_way_that_pays_are_the_float32_kernel():
    q, k, v = _qkv(70, 70, 9, 3, 64, seed=4)
    fast, exact = (prefill_attention(q, k, v, 0.125, True, bf16_products=flag) for flag in (True, False))
    if has_bf16_products():
        torch.testing.assert_close(fast[1], exact[1], rtol=0, atol=0.05)
        assert not torch.equal(fast[0], exact[0])
    else:
        assert torch.equal(fast[0], exact[0]) and torch.equal(fast[1], exact[1])


@pytest.mark.parametrize("gflops, way", [
    ({"float32": 100.0, "amx": 230.0, "avx512_bf16": 74.0}, "amx"),  # Sapphire Rapids: vdpbf16ps slower than float32
    ({"float32": 100.0, "avx512_bf16": 140.0}, "avx512_bf16"),  # no AMX
    ({"float32": 100.0, "amx": 105.0, "avx512_bf16": 140.0}, "avx512_bf16"),  # tiles that did not pay
    ({"float32": 100.0, "avx512_bf16": 110.0}, ""),  # rounding to bf16 for a gain within the noise
    ({"float32": 100.0}, ""),
])
def test_the_start_up_choice_takes_the_preferred_way_that_pays(gflops, way):
    assert pick_way(gflops) == way


def test_an_unknown_bf16_way_is_refused():
    q, k, v = _qkv(4, 4, 2, 1, 64)
    with pytest.raises(ValueError, match="bf16_way 'tiles'"):
        prefill_attention(q, k, v, 0.1, True, bf16_products=True, bf16_way="tiles")


@pytest.mark.parametrize("way, d", [(None, 64), (None, 36), ("avx512_bf16", 64), ("amx", 64)])
def test_bf16_output_is_the_float32_output_rounded_as_torch_rounds(way, d):
    """out_dtype bfloat16: every way writes its float32 output rounded to nearest even, bit for bit torch's cast of
    that output (the whole 16-lane blocks and, at head size 36, the word-by-word rest), with the same lse."""
    _skip_unless_built(way)
    q, k, v = _qkv(150, 150, 6, 2, d, seed=11)
    v[:, 0, 0], v[:, 0, 1] = 5e-39, 1e30  # outputs that are float32 subnormals, and large ones: rounding's edges
    wide, wide_lse = prefill_attention(q, k, v, 0.1, True, bf16_products=way is not None, bf16_way=way)
    narrow, narrow_lse = prefill_attention(q, k, v, 0.1, True, bf16_products=way is not None, bf16_way=way,
                                           out_dtype=torch.bfloat16)
    assert narrow.dtype == torch.bfloat16 and torch.equal(narrow_lse, wide_lse)
    assert torch.equal(narrow.view(torch.int16), wide.to(torch.bfloat16).view(torch.int16))


def test_an_output_dtype_other_than_float32_or_bfloat16_is_refused():
    q, k, v = _qkv(4, 4, 2, 1, 64)
    with pytest.raises(ValueError, match="out_dtype torch.float16"):
        prefill_attention(q, k, v, 0.1, True, out_dtype=torch.float16)
