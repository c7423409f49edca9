"""Where each token's K/V lives when the KV cache is sharded over a CP group.

docs/context_parallel.md, "KV layout". With `C = num_shards` and `I = interleave`, token `pos` belongs to
rank `(pos // I) % C`, at index `(pos // (C*I))*I + pos % I` of that rank's local
sequence. The scheduler counts virtual blocks of `block_size * C` tokens; one
block id names the same physical block index on every CP rank, and each rank
fills it with its own `block_size` local tokens. So the block table is identical
on every rank and only ownership differs.

Because `I` divides `block_size`, the virtual block of `pos`
(`pos // (block_size*C)`) equals the local block of its owner
(`local_index(pos) // block_size`).

The `KVLayout` methods are pure Python; `local_context_slots` is the vectorised
torch version the per-step metadata uses for a request's cached context.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(kw_only=True, frozen=True, slots=True)
class KVLayout:
    """Token-to-rank mapping of the KV cache, seen from one CP rank."""

    num_shards: int
    """Ranks one request's KV is divided over (`C`: PCP * DCP in the sharded layout, DCP in the replicated one;
    ParallelDims.kv_shard_size); 1 means no sharding."""
    shard_rank: int
    """This rank's index among them, in `[0, num_shards)` (ParallelDims.kv_shard_rank)."""
    interleave: int
    """Consecutive tokens kept together on one rank (`I`); divides `block_size`."""
    block_size: int
    """Tokens per physical block in each rank's pool."""

    def __post_init__(self) -> None:
        for name in ("num_shards", "interleave", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.shard_rank, int) or not 0 <= self.shard_rank < self.num_shards:
            raise ValueError(f"shard_rank={self.shard_rank!r} is outside [0, num_shards={self.num_shards})")
        if self.block_size % self.interleave != 0:
            raise ValueError(
                f"interleave={self.interleave} must divide block_size={self.block_size}"
            )

    @property
    def cycle(self) -> int:
        """Tokens in one round-robin cycle over all ranks (`C * I`)."""
        return self.num_shards * self.interleave

    def owner(self, pos: int) -> int:
        """CP rank that stores the K/V of absolute position `pos`."""
        return (pos // self.interleave) % self.num_shards

    def local_index(self, pos: int) -> int:
        """Index of `pos` in its owner's local sequence (meaningful on the owner only)."""
        return (pos // self.cycle) * self.interleave + pos % self.interleave

    def local_position(self, local: int) -> int:
        """The absolute position of this rank's local index `local` (the inverse of `local_index` on the owner)."""
        return (local // self.interleave) * self.cycle + self.shard_rank * self.interleave + local % self.interleave

    def num_local_tokens(self, seq_len: int) -> int:
        """Number of positions `< seq_len` that this rank owns, in O(1)."""
        if seq_len < 0:
            raise ValueError(f"seq_len must be >= 0, got {seq_len}")
        full_cycles, rest = divmod(seq_len, self.cycle)
        # In the last, partial cycle this rank's run starts at cp_rank * I.
        tail = min(max(rest - self.shard_rank * self.interleave, 0), self.interleave)
        return full_cycles * self.interleave + tail

    def virtual_block_size(self) -> int:
        """Tokens covered by one block id across the whole CP group."""
        return self.block_size * self.num_shards

    def num_virtual_blocks(self, seq_len: int) -> int:
        """Block-table entries needed for a sequence of `seq_len` tokens."""
        if seq_len < 0:
            raise ValueError(f"seq_len must be >= 0, got {seq_len}")
        return -(-seq_len // self.virtual_block_size())

    def slot(self, pos: int, block_table: Sequence[int]) -> int | None:
        """This rank's pool slot for `pos`, or None when another rank owns it."""
        if self.owner(pos) != self.shard_rank:
            return None
        local = self.local_index(pos)
        block = local // self.block_size
        if block >= len(block_table):
            raise ValueError(
                f"position {pos} needs block-table entry {block}, table has {len(block_table)}"
            )
        if block_table[block] < 0:
            raise ValueError(f"position {pos} is in block-table entry {block}, which its window freed")
        return block_table[block] * self.block_size + local % self.block_size

    def owned_positions(self, start: int, end: int) -> list[int]:
        """Positions in `[start, end)` that this rank owns, ascending."""
        if start < 0 or end < start:
            raise ValueError(f"need 0 <= start <= end, got start={start}, end={end}")
        out: list[int] = []
        # Walk this rank's runs of I tokens, beginning with the run that holds `start`.
        run = (start // self.cycle) * self.cycle + self.shard_rank * self.interleave
        while run < end:
            out.extend(range(max(run, start), min(run + self.interleave, end)))
            run += self.cycle
        return out


def local_context_slots(seq_len: int, block_table: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """Pool slots of this rank's tokens among `pos < seq_len`, local order. [num_local] long.

    `block_table` is one request's [num_blocks] table. Gathering the pool at
    these slots gives this rank's KV shard in ascending position order.
    """
    num_local = layout.num_local_tokens(seq_len)
    local = torch.arange(num_local, dtype=torch.long, device=block_table.device)
    bs = layout.block_size
    block_ids = block_table.long()[torch.div(local, bs, rounding_mode="floor")]
    # a sliding-window group's freed entries (-1, cpllm/step.py FREED_BLOCK) have no slot: -1, never read
    return (block_ids * bs + local % bs).masked_fill_(block_ids < 0, -1)


def owned_slots(positions: torch.Tensor, block_table: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """Owner's pool slots of `positions` (all owned by `layout.shard_rank`; not checked). [len(positions)] long.

    The local index does not depend on the rank, so this is `KVLayout.slot` vectorised for one request.
    """
    cycles = torch.div(positions, layout.cycle, rounding_mode="floor")
    local = cycles * layout.interleave + positions % layout.interleave
    bs = layout.block_size
    return block_table.long()[torch.div(local, bs, rounding_mode="floor")] * bs + local % bs
