"""Prefix-cache block hashes: content-addressed, chained, and the same in every process."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys

from cpllm.engine.kv_blocks import ROOT_BLOCK_HASH, BlockPool, block_hash, extend_hashes

TOKENS_PER_BLOCK = 4


def chain(token_ids: list[int]) -> list[bytes]:
    hashes: list[bytes] = []
    extend_hashes(hashes, token_ids, TOKENS_PER_BLOCK, len(token_ids) // TOKENS_PER_BLOCK)
    return hashes


def test_equal_prefixes_hash_equal_and_a_changed_token_changes_its_block_and_all_later():
    tokens = list(range(100, 116))  # 4 full blocks
    base = chain(tokens)
    assert base == chain(list(tokens))
    assert len(set(base)) == 4
    for changed_pos in range(len(tokens)):
        edited = list(tokens)
        edited[changed_pos] += 1
        hashes = chain(edited)
        first_changed_block = changed_pos // TOKENS_PER_BLOCK
        assert hashes[:first_changed_block] == base[:first_changed_block]
        for i in range(first_changed_block, 4):
            assert hashes[i] != base[i], (changed_pos, i)


def test_hash_is_sha256_of_parent_digest_and_little_endian_int64_tokens():
    tokens = (1, 2, 3, 70_000)
    expected = hashlib.sha256(ROOT_BLOCK_HASH + struct.pack("<4q", *tokens)).digest()
    assert block_hash(ROOT_BLOCK_HASH, tokens) == expected
    assert chain(list(tokens)) == [expected]


def test_hash_is_the_same_in_another_process_with_another_hash_seed():
    code = (
        "from cpllm.engine.kv_blocks import extend_hashes\n"
        "h = []\n"
        "extend_hashes(h, list(range(100, 116)), 4, 4)\n"
        "print(','.join(x.hex() for x in h))"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert result.stdout.strip() == ",".join(h.hex() for h in chain(list(range(100, 116))))


def test_token_boundaries_are_unambiguous():
    # Tokens (1, 23) and (12, 3) must not collide, as a decimal string encoding would.
    assert block_hash(ROOT_BLOCK_HASH, (1, 23)) != block_hash(ROOT_BLOCK_HASH, (12, 3))


def test_lookup_finds_the_registered_prefix_by_hash():
    pool = BlockPool(4, enable_prefix_caching=True)
    hashes = chain(list(range(8)))
    blocks = pool.allocate(2)
    for block_id, h in zip(blocks, hashes):
        pool.register(block_id, h)
    pool.free(blocks)
    other = chain([0, 1, 2, 3, 9, 9, 9, 9])
    assert pool.lookup_prefix(other) == blocks[:1]
    assert pool.lookup_prefix(hashes) == blocks
