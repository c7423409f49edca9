"""Head-tail PCP partition of new tokens (docs/context_parallel.md, "Prefill partition")."""

import math

import pytest

from cpllm.context_parallel.partition import (
    joined_key_runs,
    head_tail_chunks,
    rank_num_tokens,
    rank_token_indices,
    rank_token_ranges,
)

CASES = [(t, p) for t in range(0, 71) for p in range(1, 6)]


@pytest.mark.parametrize("pcp", range(1, 6))
def test_chunks_cover_range_in_order(pcp):
    for t in range(0, 71):
        chunks = head_tail_chunks(t, pcp)
        assert len(chunks) == 2 * pcp
        chunk = math.ceil(t / (2 * pcp))
        expected_pos = 0
        for i, (s, e) in enumerate(chunks):
            assert s == expected_pos and s <= e <= t
            assert e - s == max(0, min(chunk, t - i * chunk))
            expected_pos = e
        assert expected_pos == t


@pytest.mark.parametrize("pcp", range(1, 6))
def test_ranks_partition_tokens_head_tail(pcp):
    for t in range(0, 71):
        if t == 1:
            continue
        chunks = head_tail_chunks(t, pcp)
        seen = []
        for p in range(pcp):
            ranges = rank_token_ranges(t, pcp, p)
            assert all(e > s for s, e in ranges) and len(ranges) <= 2
            head, tail = chunks[p], chunks[2 * pcp - 1 - p]
            if head[1] == tail[0]:  # touching chunks (one PCP rank) are one run
                want = [(head[0], tail[1])] if tail[1] > head[0] else []
            else:
                want = [c for c in (head, tail) if c[1] > c[0]]
            assert ranges == want
            idx = rank_token_indices(t, pcp, p)
            assert idx == sorted(idx)
            assert rank_num_tokens(t, pcp, p) == len(idx)
            seen.extend(idx)
        assert sorted(seen) == list(range(t))


@pytest.mark.parametrize("pcp", range(1, 6))
def test_balanced(pcp):
    # Each rank gets at most 2 * chunk tokens; when T fills all chunks
    # (T divisible by 2*PCP) every rank gets exactly T / PCP and equal causal work.
    for t in range(2, 71):
        chunk = math.ceil(t / (2 * pcp))
        counts = [rank_num_tokens(t, pcp, p) for p in range(pcp)]
        assert max(counts) <= 2 * chunk
        if t % (2 * pcp) == 0:
            assert counts == [t // pcp] * pcp
            # causal work of token i is i + 1 keys
            work = [sum(i + 1 for i in rank_token_indices(t, pcp, p)) for p in range(pcp)]
            assert len(set(work)) == 1


def test_design_examples():
    assert head_tail_chunks(10, 2) == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert rank_token_indices(10, 2, 0) == [0, 1, 2, 9]
    assert rank_token_indices(10, 2, 1) == [3, 4, 5, 6, 7, 8]
    assert head_tail_chunks(5, 2) == [(0, 2), (2, 4), (4, 5), (5, 5)]
    assert rank_token_indices(5, 2, 0) == [0, 1]
    assert rank_token_indices(5, 2, 1) == [2, 3, 4]
    assert rank_token_ranges(5, 2, 0) == [(0, 2)]


def test_decode_not_split():
    for pcp in range(1, 6):
        for p in range(pcp):
            assert rank_token_ranges(1, pcp, p) == [(0, 1)]
            assert rank_token_indices(1, pcp, p) == [0]


def test_empty_request():
    for pcp in range(1, 6):
        assert head_tail_chunks(0, pcp) == [(0, 0)] * (2 * pcp)
        assert all(rank_token_ranges(0, pcp, p) == [] for p in range(pcp))


def test_invalid_arguments():
    with pytest.raises(ValueError, match="pcp_size"):
        head_tail_chunks(4, 0)
    with pytest.raises(ValueError, match="num_tokens"):
        head_tail_chunks(-1, 2)
    with pytest.raises(ValueError, match="pcp_rank=2"):
        rank_token_ranges(4, 2, 2)


def test_joined_key_runs_join_a_run_to_the_keys_just_before_it():
    # block rows: [chunk 0 (tokens 0..3), chunk 3 (tokens 12..15)], as PCP rank 0 of 2 holds them
    own_block = [(0, 0, 4), (4, 12, 4)]
    assert joined_key_runs(own_block, 0) == [(slice(0, 4), 0)]  # chunk 0: itself, square causal
    assert joined_key_runs(own_block, 12) == [(slice(0, 8), 4)]  # chunk 3: chunk 0 then itself, one call
    other_block = [(0, 4, 4), (4, 8, 4)]  # rank 1's chunks 1 and 2: wholly before chunk 3, after chunk 0
    assert joined_key_runs(other_block, 12) == [(slice(0, 8), None)]
    assert joined_key_runs(other_block, 0) == []
    # keys before the run but not adjacent to it in the block stay their own unmasked call
    gap = [(0, 0, 4), (4, 20, 2), (6, 12, 4)]
    assert joined_key_runs(gap, 12) == [(slice(0, 4), None), (slice(6, 10), 0)]
