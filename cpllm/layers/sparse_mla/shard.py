"""Which positions of a request this rank holds, and where (torch only): the KV layout's arithmetic
(cpllm/context_parallel/kv_layout.py) on tensors of positions, so a layer maps the global top-k back to its own
keys without a search."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(kw_only=True, frozen=True, slots=True)
class KeyShard:
    """This rank's share of every request's positions: position p lives on rank (p // I) % C at local index
    (p // (C I)) I + p % I, local order being position order."""

    num_shards: int
    """C: ranks one request's cache is divided over (1: this rank holds every position)."""
    shard_rank: int
    """This rank's index among them."""
    interleave: int
    """I: consecutive positions kept on one rank."""

    @classmethod
    def of(cls, layout) -> "KeyShard":
        """From a step's KVLayout (None: a metadata built by hand for one rank)."""
        if layout is None:
            return cls(num_shards=1, shard_rank=0, interleave=1)
        return cls(num_shards=layout.num_shards, shard_rank=layout.shard_rank, interleave=layout.interleave)

    def positions(self, local: torch.Tensor) -> torch.Tensor:
        """Local indices [T] -> their positions [T]."""
        i, c = self.interleave, self.num_shards
        return torch.div(local, i, rounding_mode="floor") * c * i + self.shard_rank * i + local % i

    def local_index(self, positions: torch.Tensor) -> torch.Tensor:
        """Positions -> their local index on their owner (meaningful where `owned`)."""
        i, c = self.interleave, self.num_shards
        return torch.div(positions, c * i, rounding_mode="floor") * i + positions % i

    def owned(self, positions: torch.Tensor) -> torch.Tensor:
        """Positions -> whether this rank holds them (bool)."""
        return torch.div(positions, self.interleave, rounding_mode="floor") % self.num_shards == self.shard_rank
