"""KV cache sharding over the CP group (docs/context_parallel.md, "KV layout") against brute force."""

import itertools
import random

import pytest
import torch

from cpllm.context_parallel.kv_layout import KVLayout, local_context_slots

# (cp_size, interleave, block_size) with interleave dividing block_size
CONFIGS = [
    (c, i, b)
    for c, b in itertools.product((1, 2, 3, 4), (1, 2, 4, 6, 8))
    for i in range(1, b + 1)
    if b % i == 0
]


def brute_force(cp_size, interleave, seq_len):
    """Deal tokens round robin in runs of `interleave`: owner and local index per position."""
    owners, locals_ = [], []
    counts = [0] * cp_size
    rank = 0
    for pos in range(seq_len):
        if pos > 0 and pos % interleave == 0:
            rank = (rank + 1) % cp_size
        owners.append(rank)
        locals_.append(counts[rank])
        counts[rank] += 1
    return owners, locals_


def random_block_table(num_blocks, rng):
    return rng.sample(range(3 * num_blocks + 5), num_blocks)


def test_design_table():
    layouts = [KVLayout(num_shards=2, shard_rank=r, interleave=2, block_size=4) for r in range(2)]
    owners = [layouts[0].owner(p) for p in range(10)]
    assert owners == [0, 0, 1, 1, 0, 0, 1, 1, 0, 0]
    assert [layouts[0].local_index(p) for p in range(10)] == [0, 1, 0, 1, 2, 3, 2, 3, 4, 5]
    assert [layouts[0].local_index(p) // 4 for p in range(10)] == [0] * 8 + [1, 1]
    assert layouts[0].virtual_block_size() == 8
    assert layouts[0].num_virtual_blocks(10) == 2
    table = [7, 3]
    assert local_context_slots(10, torch.tensor(table), layouts[0]).tolist() == [28, 29, 30, 31, 12, 13]
    assert local_context_slots(10, torch.tensor(table), layouts[1]).tolist() == [28, 29, 30, 31]
    assert layouts[0].slot(9, table) == 13 and layouts[1].slot(9, table) is None


@pytest.mark.parametrize("cp_size,interleave,block_size", CONFIGS)
def test_scalar_api_vs_brute_force(cp_size, interleave, block_size):
    max_len = 3 * cp_size * block_size + 5
    owners, locals_ = brute_force(cp_size, interleave, max_len)
    for rank in range(cp_size):
        lay = KVLayout(num_shards=cp_size, shard_rank=rank, interleave=interleave, block_size=block_size)
        for pos in range(max_len):
            assert lay.owner(pos) == owners[pos]
            if owners[pos] == rank:
                assert lay.local_index(pos) == locals_[pos]
        for seq_len in range(max_len + 1):
            assert lay.num_local_tokens(seq_len) == owners[:seq_len].count(rank)
            assert lay.num_virtual_blocks(seq_len) == -(-seq_len // (block_size * cp_size))
        for start, end in [(0, max_len), (1, 1), (3, 7), (interleave, max_len - 1), (5, 6)]:
            want = [p for p in range(start, end) if owners[p] == rank]
            assert lay.owned_positions(start, end) == want


@pytest.mark.parametrize("cp_size,interleave,block_size", CONFIGS)
def test_slots_disjoint_and_inside_blocks(cp_size, interleave, block_size):
    rng = random.Random(cp_size * 7 + interleave * 3 + block_size)
    seq_len = rng.randint(1, 4 * cp_size * block_size + 3)
    for rank in range(cp_size):
        lay = KVLayout(num_shards=cp_size, shard_rank=rank, interleave=interleave, block_size=block_size)
        table = random_block_table(lay.num_virtual_blocks(seq_len), rng)
        allowed = {b * block_size + j for b in table for j in range(block_size)}
        slots = [lay.slot(p, table) for p in range(seq_len)]
        mine = [s for s in slots if s is not None]
        assert len(mine) == lay.num_local_tokens(seq_len)
        assert len(set(mine)) == len(mine), "two positions share a slot"
        assert set(mine) <= allowed
        # the vectorised context slots list them in local (= ascending position) order
        assert local_context_slots(seq_len, torch.tensor(table), lay).tolist() == mine


def test_every_token_stored_once_across_ranks():
    # With a block table shared by all ranks, positions map to distinct (rank, slot) pairs.
    for cp_size, interleave, block_size in CONFIGS:
        seq_len = 2 * cp_size * block_size + 1
        table = list(range(10, 10 + -(-seq_len // (cp_size * block_size))))
        stored = []
        for rank in range(cp_size):
            lay = KVLayout(num_shards=cp_size, shard_rank=rank, interleave=interleave, block_size=block_size)
            stored += [(rank, lay.slot(p, table)) for p in range(seq_len) if lay.slot(p, table) is not None]
        assert len(stored) == seq_len == len(set(stored))


def test_validation():
    with pytest.raises(ValueError, match="shard_rank=2"):
        KVLayout(num_shards=2, shard_rank=2, interleave=1, block_size=4)
    with pytest.raises(ValueError, match="interleave=3 must divide block_size=4"):
        KVLayout(num_shards=2, shard_rank=0, interleave=3, block_size=4)
    with pytest.raises(ValueError, match="block_size"):
        KVLayout(num_shards=2, shard_rank=0, interleave=1, block_size=0)
    lay = KVLayout(num_shards=2, shard_rank=0, interleave=1, block_size=4)
    with pytest.raises(ValueError, match="table has 1"):
        lay.slot(8, [0])
    with pytest.raises(ValueError, match="seq_len"):
        lay.num_local_tokens(-1)
