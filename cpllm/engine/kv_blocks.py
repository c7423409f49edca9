"""Virtual KV block pool with reference counts and prefix caching (torch-free).

A block id names the same physical block index on every rank of a CP group;
one virtual block holds `block_size * kv_shard_size` consecutive tokens of a sequence
(docs/context_parallel.md, "KV layout"), so the scheduler only counts virtual blocks. A model with several KV groups
(cpllm/kv_groups.py: full attention, sliding windows) has one pool per group; the same prefix hash names a block of
each group's pool.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from dataclasses import dataclass

from cpllm.step import FREED_BLOCK

ROOT_BLOCK_HASH = hashlib.sha256(b"cpllm prefix cache root").digest()
"""Parent of the first block of every sequence (a fixed value, so hashes agree across processes)."""


def block_hash(parent: bytes, tokens: tuple[int, ...]) -> bytes:
    """Identity of a full block: its tokens and everything before them.

    A collision would hand a request another prefix's KV, so this is SHA-256
    (Python's hash() is 64-bit and not guaranteed equal across processes). The encoding is
    unambiguous: a 32-byte parent digest, then one little-endian int64 per token.
    """
    return hashlib.sha256(parent + struct.pack(f"<{len(tokens)}q", *tokens)).digest()


@dataclass(slots=True)
class _Block:
    ref_count: int = 0
    hash: bytes | None = None


class BlockPool:
    """Allocates virtual blocks; freed blocks with a hash stay reusable until evicted (LRU)."""

    def __init__(self, num_blocks: int, enable_prefix_caching: bool):
        if num_blocks < 1:
            raise ValueError(f"the KV cache holds {num_blocks} blocks; at least 1 is needed")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks = [_Block() for _ in range(num_blocks)]
        # Free blocks in eviction order: never-used and uncached ones first, then least recently freed.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, int] = {}  # block hash -> block id

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Blocks referenced by running requests."""
        return self.num_blocks - len(self._free)

    def usage(self) -> float:
        """Fraction of blocks referenced by running requests."""
        return 1.0 - self.num_free / self.num_blocks

    def allocate(self, count: int) -> list[int] | None:
        """Take `count` fresh blocks, evicting cached ones as needed; None when too few are free."""
        if count > len(self._free):
            return None
        ids = []
        for _ in range(count):
            block_id, _ = self._free.popitem(last=False)
            block = self._blocks[block_id]
            if block.hash is not None:
                del self._cached[block.hash]
                block.hash = None
            block.ref_count = 1
            ids.append(block_id)
        return ids

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference of each block (FREED_BLOCK entries skipped); the last reference returns it to the
        free list."""
        for block_id in reversed(block_ids):  # tail blocks are evicted before the shared prefix
            if block_id == FREED_BLOCK:
                continue
            block = self._blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.hash is None:
                    self._free.move_to_end(block_id, last=False)

    def lookup_prefix(self, hashes: list[bytes]) -> list[int]:
        """Longest run of leading cached blocks for these block hashes; each gains a reference."""
        hits = []
        if not self.enable_prefix_caching:
            return hits
        for h in hashes:
            block_id = self._cached.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        self.acquire(hits)
        return hits

    def cached(self, h: bytes) -> int | None:
        """The block registered for prefix hash `h`, or None (no reference taken)."""
        return self._cached.get(h) if self.enable_prefix_caching else None

    def acquire(self, block_ids: list[int]) -> None:
        """Take one more reference of each (cached) block, out of the free list if it was there."""
        for block_id in block_ids:
            block = self._blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1

    def register(self, block_id: int, h: bytes) -> None:
        """Mark a full, computed block as reusable for the prefix with hash `h`."""
        if not self.enable_prefix_caching or h in self._cached:
            return
        self._blocks[block_id].hash = h
        self._cached[h] = block_id

    @property
    def cached_hashes(self) -> frozenset[bytes]:
        """The prefix hashes registered now: what a later request could find."""
        return frozenset(self._cached) if self.enable_prefix_caching else frozenset()

    def reset_prefix_cache(self) -> None:
        for block in self._blocks:
            block.hash = None
        self._cached.clear()


def extend_hashes(hashes: list[bytes], token_ids: list[int], tokens_per_block: int, num_blocks: int) -> None:
    """Append the chained hashes of full blocks len(hashes)..num_blocks-1 of a token sequence."""
    for i in range(len(hashes), num_blocks):
        parent = hashes[-1] if hashes else ROOT_BLOCK_HASH
        hashes.append(block_hash(parent, tuple(token_ids[i * tokens_per_block : (i + 1) * tokens_per_block])))
