"""The disaggregated re-shard plan (cpllm/disagg/reshard.py) against the KV ownership formula.

For every pair of layouts (PCP, DCP, TP, either KV layout, interleave, block size) the plan must move each
(position, KV head) once to every consumer rank that owns it (context_parallel.md "KV layout" on the consumer's
KV-shard group, kv_heads_of_tp_rank for heads), from a producer rank that holds it, and move nothing else."""

from __future__ import annotations

import itertools

import pytest

from cpllm.context_parallel.kv_layout import KVLayout
from cpllm.disagg.reshard import CacheLayout, plan_reshard
from cpllm.distributed.parallel_dims import ParallelDims, kv_heads_of_tp_rank, valid_dcp_sizes


def _layouts(num_kv_heads: int, block_size: int = 8):
    """Every valid layout with at most 8 ranks, each KV layout, interleave 1, 2 and the block size."""
    for tp, pcp in itertools.product((1, 2, 4), (1, 2)):
        for dcp in valid_dcp_sizes(tp, num_kv_heads):
            if tp % dcp:
                continue
            for replicated in ((False, True) if pcp > 1 else (False,)):
                for interleave in sorted({1, 2, block_size}):
                    dims = ParallelDims(tp=tp, pcp=pcp, dcp=dcp, kv_replicated=replicated)
                    yield CacheLayout(dims=dims, interleave=interleave, block_size=block_size)


def _kv_layout(layout: CacheLayout, rank: int) -> KVLayout:
    """The engine's own KVLayout of one rank (the formula the plan must agree with)."""
    return KVLayout(num_shards=layout.dims.kv_shard_size, shard_rank=layout.dims.kv_shard_rank(rank),
                    interleave=layout.interleave, block_size=layout.block_size)



def _owned(layout: CacheLayout, rank: int, num_kv_heads: int, num_tokens: int,
           first_token: int = 0) -> set[tuple[int, int]]:
    kv = _kv_layout(layout, rank)
    first, count = kv_heads_of_tp_rank(num_kv_heads, layout.dims.tp, layout.dims.coords(rank)[2])
    return {(p, h) for p in kv.owned_positions(first_token, num_tokens) for h in range(first, first + count)}


def _check(src: CacheLayout, dst: CacheLayout, num_kv_heads: int, num_tokens: int, first_token: int = 0) -> None:
    plan = plan_reshard(src, dst, num_kv_heads, num_tokens, first_token)
    src_holds = {s: _owned(src, s, num_kv_heads, num_tokens) for s in range(src.num_ranks)}
    for d in range(dst.num_ranks):
        received: list[tuple[int, int]] = []
        for move in plan.to(d):
            rows = [(p, h) for a, b in move.ranges for p in range(a, b) for h in move.heads]
            assert set(rows) <= src_holds[move.src_rank], (move, "sends a row its producer rank does not hold")
            received += rows
            starts = [a for a, _ in move.ranges]
            assert starts == sorted(starts) and all(b > a for a, b in move.ranges)
            assert all(b1 < a2 for (_, b1), (a2, _) in zip(move.ranges, move.ranges[1:])), "runs not merged"
        assert len(received) == len(set(received)), f"rank {d} receives a row twice"
        assert set(received) == _owned(dst, d, num_kv_heads, num_tokens, first_token), \
            f"rank {d} misses or gets foreign rows"


@pytest.mark.parametrize("num_kv_heads", [1, 2, 4])
def test_every_layout_pair(num_kv_heads):
    layouts = list(_layouts(num_kv_heads))
    for src, dst in itertools.product(layouts, layouts):
        for num_tokens in (0, 1, 13, 40):
            _check(src, dst, num_kv_heads, num_tokens)


def test_block_sizes_differ():
    src = CacheLayout(dims=ParallelDims(pcp=2), interleave=4, block_size=16)
    dst = CacheLayout(dims=ParallelDims(tp=2, dcp=2), interleave=1, block_size=4)
    for n in (1, 37, 100):
        _check(src, dst, 2, n)


def test_a_prefix_hit_on_the_consumer_moves_only_the_rest():
    """Positions before first_token are the consumer's own prefix-cache hit (whole blocks of its layout)."""
    layouts = list(_layouts(2))
    for src, dst in itertools.product(layouts[::3], layouts[::3]):
        for first_token, num_tokens in ((8, 13), (16, 40), (40, 40)):
            _check(src, dst, 2, num_tokens, first_token)
    with pytest.raises(ValueError, match=r"first_token must be an integer in \[0, num_tokens=4\], got 5"):
        plan_reshard(src, dst, 2, 4, 5)


def test_pcp2_to_one_rank_is_two_interleaved_streams():
    src = CacheLayout(dims=ParallelDims(pcp=2), interleave=2, block_size=4)
    dst = CacheLayout(dims=ParallelDims(), interleave=1, block_size=16)
    plan = plan_reshard(src, dst, 2, 9)
    assert [(m.src_rank, m.dst_rank, tuple(m.heads), m.ranges) for m in plan.moves] == [
        (0, 0, (0, 1), ((0, 2), (4, 6), (8, 9))),
        (1, 0, (0, 1), ((2, 4), (6, 8))),
    ]


def test_replicated_copies_spread_over_producers():
    """Under the replicated layout both PCP ranks hold everything: consumer ranks pull from different ones."""
    src = CacheLayout(dims=ParallelDims(pcp=2, kv_replicated=True), interleave=1, block_size=4)
    dst = CacheLayout(dims=ParallelDims(pcp=2), interleave=1, block_size=4)
    plan = plan_reshard(src, dst, 1, 8)
    assert {(m.src_rank, m.dst_rank) for m in plan.moves} == {(0, 0), (1, 1)}
    _check(src, dst, 1, 8)


def test_heads_split_over_source_tp():
    """TP = 2 producer (2 heads each) -> one rank: one move per producer rank, each its own heads."""
    src = CacheLayout(dims=ParallelDims(tp=2), interleave=1, block_size=4)
    dst = CacheLayout(dims=ParallelDims(), interleave=1, block_size=4)
    plan = plan_reshard(src, dst, 4, 5)
    assert [(m.src_rank, tuple(m.heads), m.ranges) for m in plan.moves] == [(0, (0, 1), ((0, 5),)),
                                                                             (1, (2, 3), ((0, 5),))]


def test_layout_round_trips_and_refusals():
    layout = CacheLayout(dims=ParallelDims(tp=2, pcp=2, dcp=2, kv_replicated=True), interleave=2, block_size=8)
    assert CacheLayout.from_dict(layout.to_dict()) == layout
    with pytest.raises(ValueError, match="data_parallel_size=2"):
        CacheLayout(dims=ParallelDims(dp=2), interleave=1, block_size=4)
    with pytest.raises(ValueError, match="interleave=3 must divide block_size=8"):
        CacheLayout(dims=ParallelDims(), interleave=3, block_size=8)
    with pytest.raises(ValueError, match="num_tokens must be an integer >= 0, got -1"):
        plan_reshard(layout, layout, 2, -1)


def test_local_index_matches_kv_layout():
    for layout in _layouts(2):
        for rank in range(layout.num_ranks):
            kv = _kv_layout(layout, rank)
            for p in kv.owned_positions(0, 50):
                assert layout.owner(p) == kv.shard_rank and layout.local_index(p) == kv.local_index(p)


def test_plan_is_torch_free():
    import subprocess
    import sys
    code = "import sys, cpllm.disagg.reshard; assert 'torch' not in sys.modules, 'reshard imported torch'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_split_ranges_keeps_order_and_bounds_each_piece():
    from cpllm.disagg.reshard import split_ranges

    ranges = ((0, 2), (4, 9), (12, 13))
    for size in (1, 2, 3, 5, 8, 100):
        pieces = split_ranges(ranges, size)
        flat = [p for piece in pieces for a, b in piece for p in range(a, b)]
        assert flat == [p for a, b in ranges for p in range(a, b)]
        assert all(sum(b - a for a, b in piece) <= size for piece in pieces)
        assert all(sum(b - a for a, b in piece) == size for piece in pieces[:-1])
    assert split_ranges((), 4) == []
    with pytest.raises(ValueError, match="max_positions must be an integer >= 1, got 0"):
        split_ranges(ranges, 0)
