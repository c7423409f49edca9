"""One rank's parallel context: the one object the model's layers receive for everything that crosses ranks.

It holds the parallel dims (cpllm/distributed/parallel_dims.py), this rank's global rank and its process group of
every kind (`GROUP_KINDS`: "tp", "pcp", "dcp", "cp", "kv_shard", "dp", "replica", "moe"). A layer asks it
`rank(kind)`, `size(kind)`, `group(kind)`, the members of a group and their coordinates, the KV heads this rank
holds, or `comm(kind)`: the collective helpers bound to that group. Every coordinate is the dims' arithmetic, so no
layer takes a rank apart by hand. The runner builds it once per rank from the process groups
(`ParallelGroups.context`); a test builds one from dims and a rank alone, to compute one rank's shard in a single
process (its groups then absent: see `groups`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import torch

from cpllm.distributed import comm as collectives
from cpllm.distributed.comm import Group
from cpllm.distributed.parallel_dims import GROUP_KINDS, ParallelDims

@dataclass(kw_only=True, frozen=True, slots=True)
class GroupComm:
    """This rank's group of one kind, with the collectives bound to it (each returns at once for a group of one,
    or where the group is absent; the process group carries its own time limit, set when it was made)."""

    kind: str
    """The group kind (one of GROUP_KINDS)."""
    rank: int
    """This rank's position in the group."""
    size: int
    """Ranks of the group."""
    group: Group = None
    """The process group (None: a group of one, or a rank computed alone)."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return collectives.all_reduce(x, self.group)

    def all_gather(self, x: torch.Tensor, *, dim: int = 0) -> torch.Tensor:
        return collectives.all_gather(x, self.group, dim=dim)

    def reduce_scatter(self, x: torch.Tensor, *, dim: int = 0) -> torch.Tensor:
        return collectives.reduce_scatter(x, self.group, dim=dim)


@dataclass(kw_only=True, frozen=True, slots=True)
class ParallelContext:
    """The dims, this rank's place in them and its process groups; read by every layer, built once per rank."""

    dims: ParallelDims = ParallelDims()
    """The parallel dims every rank shares."""
    global_rank: int = 0
    """This process's rank in the world (its coordinates are the dims' `coords`)."""
    groups: Mapping[str, Group] = field(default_factory=dict)
    """This rank's process group of each kind. A kind left out is None: a group of one, or, in a test that builds
    one rank's shard in a single process, a group whose collectives are skipped (each shard then computes its own
    partial)."""
    prefill_strategy: str = "allgather"
    """How prefill moves data over PCP when a step's metadata does not say: "allgather" or "ring" (new K/V travel),
    "pass-q" (queries travel, cpllm/context_parallel/pass_q.py); the engine's option (validated by its config)."""
    _comms: dict = field(init=False, repr=False, compare=False)
    """GroupComm per kind, made once: layers read them in every step."""
    _members: dict = field(init=False, repr=False, compare=False)
    """Global ranks of this rank's group of each kind, in group-rank order."""

    def __post_init__(self) -> None:
        unknown = sorted(set(self.groups) - set(GROUP_KINDS))
        if unknown:
            raise ValueError(f"unknown group kinds {unknown}; choose from {GROUP_KINDS}")
        self.dims.coords(self.global_rank)  # a ValueError naming the world size if the rank lies outside it
        members = {kind: tuple(self.dims.members(kind, self.global_rank)) for kind in GROUP_KINDS}
        comms = {kind: GroupComm(kind=kind, rank=ranks.index(self.global_rank), size=len(ranks),
                                 group=self.groups.get(kind)) for kind, ranks in members.items()}
        object.__setattr__(self, "_members", members)
        object.__setattr__(self, "_comms", comms)

    @classmethod
    def at(cls, dims: ParallelDims, *, dp_rank: int = 0, pcp_rank: int = 0, tp_rank: int = 0, **fields
           ) -> "ParallelContext":
        """The context of the rank at these coordinates (`fields`: groups, prefill_strategy)."""
        return cls(dims=dims, global_rank=dims.rank_of(dp_rank, pcp_rank, tp_rank), **fields)

    def comm(self, kind: str) -> GroupComm:
        """This rank's group of `kind` with its collectives."""
        if kind not in self._comms:
            raise ValueError(f"unknown group kind {kind!r}; choose one of {GROUP_KINDS}")
        return self._comms[kind]

    def group(self, kind: str) -> Group:
        """The process group of `kind` (None: a group of one; never pass None to torch.distributed: see groups.py)."""
        return self.comm(kind).group

    def rank(self, kind: str) -> int:
        """This rank's position in its group of `kind`."""
        return self.comm(kind).rank

    def size(self, kind: str) -> int:
        """Ranks of the group of `kind`."""
        return self.comm(kind).size

    def members(self, kind: str) -> tuple[int, ...]:
        """Global ranks of this rank's group of `kind`, in group-rank order."""
        self.comm(kind)
        return self._members[kind]

    def member_coords(self, kind: str, index: int) -> tuple[int, int]:
        """(PCP rank, DCP rank) of the member at group rank `index` of this rank's group of `kind`."""
        member = self.members(kind)[index]
        return self.dims.coords(member)[1], self.dims.dcp_rank(member)

    def member_cp_ranks(self, kind: str) -> tuple[int, ...]:
        """The cp-group rank of each member of this rank's group of `kind` (kinds inside the cp group: pcp, dcp,
        cp, kv_shard), in group-rank order."""
        return tuple(self.dims.cp_rank(member) for member in self.members(kind))

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """(first KV head, count) this rank holds (`parallel_dims.kv_heads_of_tp_rank`)."""
        return self.dims.kv_heads(num_kv_heads, self.global_rank)
