"""The process groups of every parallel dimension, built from the named dims.

Which ranks form each group is `ParallelDims` arithmetic (cpllm/distributed/parallel_dims.py: no
torch.distributed, tested exhaustively). `ParallelGroups` is the per-process runtime object: the dims, this
rank's coordinates and one process group per group kind; its `context()` is what the model's layers receive
(cpllm/distributed/parallel_context.py).

Size-1 groups: a group of one rank is stored as `None` and no process group is
created for it. The helpers in `cpllm.distributed.comm` treat `None` as "this rank
alone" and return at once, so a layer may call them unconditionally. Never pass
one of these `None` values straight to `torch.distributed`: there `None` means
the WORLD group, which is a different (and wrong) set of ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from cpllm.config.engine import ParallelConfig
from cpllm.distributed.comm import Group
from cpllm.distributed.parallel_context import ParallelContext
from cpllm.distributed.parallel_dims import GROUP_KINDS, ParallelDims
from cpllm.distributed.shm_group import available, host_key, open_shm_group

COMMAND_TIMEOUT_S = 365 * 24 * 3600.0
"""Time limit of the control groups' collectives (the step broadcast to a replica's ranks, the DP ticks): they wait
for the next command, which an idle engine may not send for hours. A dead peer still fails them at once (its closed
socket, or the shared-memory liveness check); the collectives inside a step keep --distributed-timeout."""


def _timeout(timeout_s: float) -> timedelta:
    return timedelta(seconds=timeout_s)


@dataclass(kw_only=True, frozen=True, slots=True)
class ParallelGroups:
    """This process's place in the dims and its process groups (None = group of one)."""

    rank: int
    """Global rank of this process."""
    dims: ParallelDims
    """The parallel dims every rank shares."""
    backend: str | None
    """Backend of the default group ("gloo" or "nccl"); None for a single process."""
    tp_group: Group
    """Tensor-parallel group (tensor collectives, default backend)."""
    pcp_group: Group
    """Prefill context-parallel group."""
    dcp_group: Group
    """Decode context-parallel group (a slice of the TP group)."""
    cp_group: Group
    """PCP x DCP ranks sharing KV heads; its group rank equals cp_rank."""
    kv_shard_group: Group
    """The ranks one request's cached K/V is divided over (cp_group, or dcp_group under the replicated layout;
    the same group object); its group rank equals kv_shard_rank."""
    dp_group: dist.ProcessGroup | None
    """Same (pcp, tp) coordinates across replicas."""
    dp_cpu_group: dist.ProcessGroup | None
    """The DP group's ranks on gloo, for the DP front's control messages (ticks, gathered outputs); no time limit
    (COMMAND_TIMEOUT_S): it waits for the next tick, and for the slowest replica's step."""
    replica_group: Group
    """All ranks of this replica on gloo, for control messages (step broadcasts); no time limit
    (COMMAND_TIMEOUT_S): it waits for the next step."""
    world_cpu_group: dist.ProcessGroup | None
    """All ranks on gloo, for control messages across replicas."""
    moe_group: Group = None
    """The replica's ranks (flattened TP x PCP) on the default backend: the MoE layers' group, and the
    replica's bounded group for tensors (the replica group, for control messages, has no time limit)."""

    # Coordinates, derived from the dims so they can never disagree with them.
    @property
    def world_size(self) -> int:
        return self.dims.world_size

    @property
    def dp_rank(self) -> int:
        return self.dims.coords(self.rank)[0]

    @property
    def pcp_rank(self) -> int:
        return self.dims.coords(self.rank)[1]

    @property
    def tp_rank(self) -> int:
        return self.dims.coords(self.rank)[2]

    @property
    def dcp_rank(self) -> int:
        return self.dims.dcp_rank(self.rank)

    @property
    def cp_rank(self) -> int:
        return self.dims.cp_rank(self.rank)

    @property
    def kv_shard_rank(self) -> int:
        return self.dims.kv_shard_rank(self.rank)

    @property
    def tp_size(self) -> int:
        return self.dims.tp

    @property
    def pcp_size(self) -> int:
        return self.dims.pcp

    @property
    def dcp_size(self) -> int:
        return self.dims.dcp

    @property
    def cp_size(self) -> int:
        return self.dims.cp_size

    @property
    def dp_size(self) -> int:
        return self.dims.dp

    @property
    def replica_size(self) -> int:
        return self.dims.replica_size

    def context(self, *, prefill_strategy: str = "allgather") -> ParallelContext:
        """The parallel context the model's layers receive: the dims, this rank and its tensor groups by kind
        (`prefill_strategy`: the engine's cp_prefill_strategy, for steps whose metadata names none)."""
        groups = {kind: getattr(self, f"{kind}_group") for kind in GROUP_KINDS}
        return ParallelContext(dims=self.dims, global_rank=self.rank, groups=groups,
                               prefill_strategy=prefill_strategy)

    @property
    def replica_ranks(self) -> list[int]:
        """Global ranks of this rank's replica, driver first."""
        return self.dims.members("replica", self.rank)

    @property
    def replica_driver(self) -> int:
        """Global rank that runs this replica's scheduler (its lowest rank)."""
        return self.replica_ranks[0]

    @property
    def is_replica_driver(self) -> bool:
        return self.rank == self.replica_driver

    @classmethod
    def single(cls, dims: ParallelDims | None = None) -> "ParallelGroups":
        """A world of one process (dims of world size 1, default all ones); needs no torch.distributed."""
        dims = dims or ParallelDims()
        if dims.world_size != 1:
            raise ValueError(f"ParallelGroups.single needs a world of one rank, got {dims}")
        return cls(rank=0, dims=dims, backend=None, tp_group=None, pcp_group=None, dcp_group=None, cp_group=None,
                   kv_shard_group=None, dp_group=None, dp_cpu_group=None, replica_group=None, world_cpu_group=None)

    @classmethod
    def build(cls, parallel: ParallelConfig, *, timeout_s: float) -> "ParallelGroups":
        """Create every group on every rank in the same order (torch.distributed requires it)."""
        dims = parallel.dims
        if not dist.is_initialized():
            if dims.world_size == 1:
                return cls.single(dims)
            raise RuntimeError(
                f"torch.distributed is not initialised but the layout needs {dims.world_size} ranks "
                f"(DP={dims.dp} x PCP={dims.pcp} x TP={dims.tp}); call init_distributed first"
            )
        world = dist.get_world_size()
        if world != dims.world_size:
            raise ValueError(
                f"the process group has {world} processes but DP={dims.dp} x PCP={dims.pcp} x "
                f"TP={dims.tp} needs {dims.world_size}"
            )
        rank = dist.get_rank()
        backend = str(dist.get_backend())
        maker = _GroupMaker(timeout_s=timeout_s, default_backend=backend)
        mine = {kind: _make_kind(maker, dims, kind, rank) for kind in GROUP_KINDS}
        world_cpu = maker.make(list(range(world)), "gloo")
        dp_cpu = _make_kind(maker, dims, "dp", rank, "gloo", COMMAND_TIMEOUT_S)
        fast = _SharedMemoryGroups.open(parallel, world_cpu, rank, timeout_s)
        # dp_group carries no tensor collectives (the DP front uses dp_cpu_group's gloo object calls)
        mine = {kind: group if kind == "dp" else fast.wrap(group, dims.members(kind, rank),
                                                           COMMAND_TIMEOUT_S if kind in _CONTROL_KINDS else timeout_s)
                for kind, group in mine.items()}
        return cls(rank=rank, dims=dims, backend=backend, dp_cpu_group=dp_cpu, world_cpu_group=world_cpu,
                   **{f"{kind}_group": group for kind, group in mine.items()})


_CONTROL_KINDS = ("replica",)
"""Group kinds for control messages: gloo, no time limit (COMMAND_TIMEOUT_S); the others carry tensors on the
default backend and time out after --distributed-timeout."""


def _make_kind(maker: "_GroupMaker", dims: ParallelDims, kind: str, rank: int, backend: str | None = None,
               limit: float | None = None) -> dist.ProcessGroup | None:
    """Every group of `kind` (all ranks create all of them, in the same order); returns this rank's."""
    if kind in _CONTROL_KINDS:
        backend, limit = "gloo", COMMAND_TIMEOUT_S
    mine = None
    for members in dims.all_groups(kind):
        group = maker.make(members, backend, limit)
        if rank in members:
            mine = group
    return mine


class _SharedMemoryGroups:
    """Puts a shared-memory fast path on each group whose ranks share this host (gloo backend only).

    Every member opens a group's mapping in the same order (the order of GROUP_KINDS), one mapping per
    distinct process group, so a group that two kinds share also shares its sequence numbers.
    """

    def __init__(self, local_ranks: set[int], rank: int):
        self._local, self._rank = local_ranks, rank
        self._opened: dict[int, Group] = {}

    @classmethod
    def open(cls, parallel: ParallelConfig, world_cpu, rank: int, timeout_s: float) -> "_SharedMemoryGroups":
        if parallel.collective_transport != "auto" or str(dist.get_backend()) != "gloo":
            return cls(set(), rank)  # the same answer on every rank: no exchange needed
        keys: list = [None] * dist.get_world_size()
        dist.all_gather_object(keys, host_key() if available() else None, group=world_cpu)
        mine = keys[rank]
        local = {r for r, key in enumerate(keys) if mine is not None and key == mine}
        return cls(local, rank)

    def wrap(self, group, members: list[int], timeout_s: float) -> Group:
        """`group` with the fast path when its members are local; `timeout_s` as the process group's."""
        if group is None or not set(members) <= self._local:
            return group
        if id(group) not in self._opened:
            opened = open_shm_group(group, members, self._rank, timeout_s)
            self._opened[id(group)] = group if opened is None else opened
        return self._opened[id(group)]


class _GroupMaker:
    """Creates process groups, reusing one when two kinds name the same ranks.

    Reuse is safe (collectives on one group run in program order on every member)
    and saves a store rendezvous per duplicate, e.g. TP == DCP when DCP == TP.
    The decision depends only on the layout, so every rank makes the same calls.
    """

    def __init__(self, *, timeout_s: float, default_backend: str) -> None:
        self._timeout_s = timeout_s
        self._default_backend = default_backend
        self._made: dict[tuple[tuple[int, ...], str, float], dist.ProcessGroup] = {}

    def make(self, members: list[int], backend: str | None, timeout_s: float | None = None
             ) -> dist.ProcessGroup | None:
        """The group of `members` on `backend` (None: the default) whose collectives time out after `timeout_s`
        (None: the engine's --distributed-timeout)."""
        if len(members) == 1:
            return None  # a group of one needs no communication at all
        if members != sorted(members):
            # new_group numbers members in sorted order; group rank must equal our order
            raise ValueError(f"group members must be in increasing rank order, got {members}")
        effective = backend or self._default_backend
        limit = self._timeout_s if timeout_s is None else timeout_s
        key = (tuple(members), effective, limit)
        if key not in self._made:
            default = effective == self._default_backend and limit == self._timeout_s
            if len(members) == dist.get_world_size() and default:
                self._made[key] = dist.group.WORLD
            else:
                self._made[key] = dist.new_group(members, timeout=_timeout(limit), backend=effective)
        return self._made[key]
