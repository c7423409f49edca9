"""The sparse-MLA kind's distributed top-k and attention on one process (cpllm/layers/sparse_mla/): the tie rule,
the top-k of per-shard candidates against the top-k of the whole set (ties included), the shard arithmetic
against the KV layout, and per-shard attention partials merged by log-sum-exp against one attention over the
selected keys."""

from __future__ import annotations

import pytest
import torch

from cpllm.context_parallel.kv_layout import KVLayout
from cpllm.context_parallel.merge import merge_attention_partials
from cpllm.layers.sparse_mla.backend import SparseMLABackend
from cpllm.layers.sparse_mla.shard import KeyShard
from cpllm.layers.sparse_mla.topk import selected_mask, top_k

NEG_INF = float("-inf")


def test_tie_rule_is_higher_score_then_lower_position():
    scores = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0]])
    positions = torch.tensor([9, 7, 2, 4, 5])  # columns in no particular order
    best, at = top_k(scores, positions, 3)
    assert at.tolist() == [[2, 5, 7]] and best.tolist() == [[3.0, 3.0, 3.0]]
    best, at = top_k(scores, positions, 4)
    assert at.tolist() == [[2, 5, 7, 4]]
    best, at = top_k(torch.tensor([[NEG_INF, 0.5]]), torch.tensor([0, 1]), 5)  # k above the keys: all of them
    assert at.tolist() == [[1, 0]] and best[0, 1].item() == NEG_INF
    with pytest.raises(ValueError, match="k=0"):
        top_k(scores, positions, 0)


@pytest.mark.parametrize("shards,interleave", [(2, 1), (2, 4), (4, 1), (4, 2)])
def test_shard_candidates_give_the_global_top_k(shards, interleave):
    """Each shard's own top-k of the keys it holds, gathered, then the top-k of the union: the same positions in
    the same order as the top-k of every key, with many exact ties (scores drawn from 5 values) and keys a row
    may not see (-inf)."""
    gen = torch.Generator().manual_seed(shards * 10 + interleave)
    rows, total, k = 6, 53, 8
    scores = torch.randint(0, 5, (rows, total), generator=gen).float()
    scores[torch.rand(rows, total, generator=gen) < 0.2] = NEG_INF
    positions = torch.arange(total)
    want_scores, want_pos = top_k(scores, positions, k)
    cand_s, cand_p = [], []
    for rank in range(shards):
        shard = KeyShard(num_shards=shards, shard_rank=rank, interleave=interleave)
        held = positions[shard.owned(positions)]
        best, at = top_k(scores[:, held], held, k)
        pad = k - best.shape[1]  # as the layer pads a shard holding fewer than k keys
        cand_s.append(torch.cat((best, torch.full((rows, pad), NEG_INF)), dim=1))
        cand_p.append(torch.cat((at, torch.full((rows, pad), -1, dtype=torch.long)), dim=1))
    got_scores, got_pos = top_k(torch.cat(cand_s, dim=1), torch.cat(cand_p, dim=1), k)
    valid = want_scores > NEG_INF
    assert torch.equal(got_scores, want_scores)
    assert torch.equal(got_pos[valid], want_pos[valid])


@pytest.mark.parametrize("shards,rank,interleave", [(1, 0, 1), (2, 1, 1), (2, 0, 4), (4, 3, 2)])
def test_key_shard_is_the_kv_layout(shards, rank, interleave):
    layout = KVLayout(num_shards=shards, shard_rank=rank, interleave=interleave, block_size=4)
    shard = KeyShard.of(layout)
    local = torch.arange(20)
    assert shard.positions(local).tolist() == [layout.local_position(i) for i in range(20)]
    positions = torch.arange(60)
    assert shard.owned(positions).tolist() == [layout.owner(p) == rank for p in range(60)]
    owned = positions[shard.owned(positions)]
    assert shard.local_index(owned).tolist() == [layout.local_index(int(p)) for p in owned]


def test_shard_partials_merge_to_one_attention_over_the_selection():
    """Two shards each attend their share of one row set's selected keys (the decode form, reading only selected
    slots, and the masked form); merged by log-sum-exp they equal one attention over all the selected keys."""
    gen = torch.Generator().manual_seed(3)
    total, width, r, heads, k = 30, 12, 8, 3, 7
    pool = torch.randn(64, 1, width, generator=gen)
    slots = torch.randperm(64, generator=gen)[:total]  # position p lives at slots[p]
    q = torch.randn(2, heads, width, generator=gen)
    selected = torch.stack([torch.randperm(total, generator=gen)[:k] for _ in range(2)])  # [2, k] positions
    backend, scale = SparseMLABackend(), 0.4
    want, want_lse = backend.attend_selected(q, pool, slots[selected], torch.ones(2, k, dtype=torch.bool), scale, r)
    dense_mask = selected_mask(selected, torch.ones(2, k, dtype=torch.bool), total)
    dense, _ = backend.attend_masked(q, pool, slots, dense_mask, scale, r)
    torch.testing.assert_close(dense, want, rtol=1e-5, atol=1e-6)
    outs, lses = [], []
    for rank in range(2):
        shard = KeyShard(num_shards=2, shard_rank=rank, interleave=2)
        held = torch.arange(total)[shard.owned(torch.arange(total))]
        mine = shard.owned(selected)
        local = shard.local_index(selected).clamp(max=held.numel() - 1)
        o, lse = backend.attend_selected(q, pool, slots[held][local], mine, scale, r)
        outs.append(o)
        lses.append(lse)
    merged, lse = merge_attention_partials(torch.stack(outs), torch.stack(lses))
    torch.testing.assert_close(merged, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-6)
    none, none_lse = backend.attend_selected(q, pool, slots[selected], torch.zeros(2, k, dtype=torch.bool), scale, r)
    assert torch.equal(none, torch.zeros_like(none)) and torch.isneginf(none_lse).all()  # no key: (0, -inf)


def test_candidates_travel_exactly():
    """The candidates' one gather carries the int32 positions' bits in float32 lanes: back exact, -1 and large
    positions included (on one rank the gather is the identity; the layouts test runs it over gloo)."""
    from cpllm.layers.sparse_mla.attention import _exchange_candidates

    scores = torch.tensor([[2.5, NEG_INF, 0.0], [1.0, 1.0, -3.0]])
    positions = torch.tensor([[7, -1, 2**31 - 1], [0, 5, 123456789]], dtype=torch.int32)
    got_scores, got_pos = _exchange_candidates(scores, positions, None)
    assert torch.equal(got_scores, scores) and got_pos.dtype == torch.long
    assert got_pos.tolist() == positions.tolist()
