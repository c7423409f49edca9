"""Which ranks form each parallel group, and the process groups built from that.

`RankLayout` is pure arithmetic (no torch.distributed) so that it can be tested
exhaustively and used by code that never starts a process. `ParallelGroups` is the
per-process runtime object: this rank's coordinates plus one process group per
parallel dimension (DESIGN section 2).

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

from cpllm.config import ParallelConfig
from cpllm.distributed.comm import Group
from cpllm.distributed.shm_group import available, host_key, open_shm_group

GROUP_KINDS = ("tp", "pcp", "dcp", "cp", "dp", "replica")
"""Every kind of group `RankLayout.all_groups` knows, in the order they are created."""


@dataclass(kw_only=True, frozen=True, slots=True)
class RankLayout:
    """Global ranks laid out as `arange(world).reshape(DP, PCP, TP)`."""

    dp: int
    """Data-parallel replicas (slowest-varying coordinate)."""
    pcp: int
    """Prefill context-parallel ranks within a replica."""
    tp: int
    """Tensor-parallel ranks (fastest-varying coordinate)."""
    dcp: int
    """Decode context-parallel ranks: consecutive TP ranks that share KV heads."""

    def __post_init__(self) -> None:
        for name in ("dp", "pcp", "tp", "dcp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"RankLayout.{name} must be an integer >= 1, got {value!r}")
        if self.tp % self.dcp != 0:
            raise ValueError(f"RankLayout: dcp={self.dcp} must divide tp={self.tp}")

    @classmethod
    def from_config(cls, parallel: ParallelConfig) -> "RankLayout":
        return cls(
            dp=parallel.data_parallel_size,
            pcp=parallel.prefill_context_parallel_size,
            tp=parallel.tensor_parallel_size,
            dcp=parallel.decode_context_parallel_size,
        )

    @property
    def world_size(self) -> int:
        return self.dp * self.pcp * self.tp

    @property
    def cp_size(self) -> int:
        return self.pcp * self.dcp

    def rank_of(self, dp_rank: int, pcp_rank: int, tp_rank: int) -> int:
        """Global rank at coordinates (dp_rank, pcp_rank, tp_rank)."""
        return (dp_rank * self.pcp + pcp_rank) * self.tp + tp_rank

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(dp_rank, pcp_rank, tp_rank) of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} is outside the world of size {self.world_size}")
        return rank // (self.pcp * self.tp), (rank // self.tp) % self.pcp, rank % self.tp

    def dcp_rank(self, rank: int) -> int:
        return self.coords(rank)[2] % self.dcp

    def cp_rank(self, rank: int) -> int:
        """Position in the KV-shard group: pcp_rank * DCP + dcp_rank."""
        _, pcp_rank, tp_rank = self.coords(rank)
        return pcp_rank * self.dcp + tp_rank % self.dcp

    def tp_group(self, rank: int) -> list[int]:
        dp_rank, pcp_rank, _ = self.coords(rank)
        return [self.rank_of(dp_rank, pcp_rank, t) for t in range(self.tp)]

    def pcp_group(self, rank: int) -> list[int]:
        dp_rank, _, tp_rank = self.coords(rank)
        return [self.rank_of(dp_rank, p, tp_rank) for p in range(self.pcp)]

    def dcp_group(self, rank: int) -> list[int]:
        dp_rank, pcp_rank, tp_rank = self.coords(rank)
        first = tp_rank - tp_rank % self.dcp
        return [self.rank_of(dp_rank, pcp_rank, first + d) for d in range(self.dcp)]

    def cp_group(self, rank: int) -> list[int]:
        """All PCP x DCP ranks that share this rank's KV heads, ordered by cp_rank."""
        dp_rank, _, tp_rank = self.coords(rank)
        first = tp_rank - tp_rank % self.dcp
        return [self.rank_of(dp_rank, p, first + d) for p in range(self.pcp) for d in range(self.dcp)]

    def dp_group(self, rank: int) -> list[int]:
        _, pcp_rank, tp_rank = self.coords(rank)
        return [self.rank_of(d, pcp_rank, tp_rank) for d in range(self.dp)]

    def replica_group(self, rank: int) -> list[int]:
        """Every rank of this rank's DP replica (PCP x TP of them), driver first."""
        first = self.coords(rank)[0] * self.pcp * self.tp
        return list(range(first, first + self.pcp * self.tp))

    def group(self, kind: str, rank: int) -> list[int]:
        if kind not in GROUP_KINDS:
            raise ValueError(f"unknown group kind {kind!r}; choose one of {GROUP_KINDS}")
        return getattr(self, f"{kind}_group")(rank)

    def all_groups(self, kind: str) -> list[list[int]]:
        """Every group of this kind, ordered by its lowest rank (the same on all ranks)."""
        groups: list[list[int]] = []
        seen: set[int] = set()
        for rank in range(self.world_size):
            if rank not in seen:
                members = self.group(kind, rank)
                seen.update(members)
                groups.append(members)
        return groups


COMMAND_TIMEOUT_S = 365 * 24 * 3600.0
"""Time limit of the control groups' collectives (the step broadcast to a replica's ranks, the DP ticks): they wait
for the next command, which an idle engine may not send for hours. A dead peer still fails them at once (its closed
socket, or the shared-memory liveness check); the collectives inside a step keep --distributed-timeout."""


def _timeout(timeout_s: float) -> timedelta:
    return timedelta(seconds=timeout_s)


@dataclass(kw_only=True, frozen=True, slots=True)
class ParallelGroups:
    """This process's place in the layout and its process groups (None = group of one)."""

    rank: int
    """Global rank of this process."""
    layout: RankLayout
    """The layout every rank shares."""
    backend: str | None
    """Backend of the default group ("gloo" or "nccl"); None for a single process."""
    tp_group: Group
    """Tensor-parallel group (tensor collectives, default backend)."""
    pcp_group: Group
    """Prefill context-parallel group."""
    dcp_group: Group
    """Decode context-parallel group (a slice of the TP group)."""
    cp_group: Group
    """KV-shard group (PCP x DCP ranks); its group rank equals cp_rank."""
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
    """The replica's ranks (flattened TP x PCP) on the default backend: the MoE layers' group (DESIGN section 9),
    and the replica's bounded group for tensors (the replica group, for control messages, has no time limit)."""

    # Coordinates and sizes, derived from the layout so they can never disagree with it.
    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def dp_rank(self) -> int:
        return self.layout.coords(self.rank)[0]

    @property
    def pcp_rank(self) -> int:
        return self.layout.coords(self.rank)[1]

    @property
    def tp_rank(self) -> int:
        return self.layout.coords(self.rank)[2]

    @property
    def dcp_rank(self) -> int:
        return self.layout.dcp_rank(self.rank)

    @property
    def cp_rank(self) -> int:
        return self.layout.cp_rank(self.rank)

    @property
    def tp_size(self) -> int:
        return self.layout.tp

    @property
    def pcp_size(self) -> int:
        return self.layout.pcp

    @property
    def dcp_size(self) -> int:
        return self.layout.dcp

    @property
    def cp_size(self) -> int:
        return self.layout.cp_size

    @property
    def dp_size(self) -> int:
        return self.layout.dp

    @property
    def replica_size(self) -> int:
        return self.layout.pcp * self.layout.tp

    @property
    def replica_driver(self) -> int:
        """Global rank that runs this replica's scheduler (its lowest rank)."""
        return self.layout.replica_group(self.rank)[0]

    @property
    def is_replica_driver(self) -> bool:
        return self.rank == self.replica_driver

    @classmethod
    def single(cls) -> "ParallelGroups":
        """A world of one process; needs no torch.distributed initialisation."""
        return cls(
            rank=0,
            layout=RankLayout(dp=1, pcp=1, tp=1, dcp=1),
            backend=None,
            tp_group=None,
            pcp_group=None,
            dcp_group=None,
            cp_group=None,
            dp_group=None,
            dp_cpu_group=None,
            replica_group=None,
            world_cpu_group=None,
        )

    @classmethod
    def build(cls, parallel: ParallelConfig, *, timeout_s: float) -> "ParallelGroups":
        """Create every group on every rank in the same order (torch.distributed requires it)."""
        layout = RankLayout.from_config(parallel)
        if not dist.is_initialized():
            if layout.world_size == 1:
                return cls.single()
            raise RuntimeError(
                f"torch.distributed is not initialised but the layout needs {layout.world_size} ranks "
                f"(DP={layout.dp} x PCP={layout.pcp} x TP={layout.tp}); call init_distributed first"
            )
        world = dist.get_world_size()
        if world != layout.world_size:
            raise ValueError(
                f"the process group has {world} processes but DP={layout.dp} x PCP={layout.pcp} x "
                f"TP={layout.tp} needs {layout.world_size}"
            )
        rank = dist.get_rank()
        backend = str(dist.get_backend())
        maker = _GroupMaker(timeout_s=timeout_s, default_backend=backend)
        mine: dict[str, dist.ProcessGroup | None] = {}
        for kind in GROUP_KINDS:
            group_backend = "gloo" if kind == "replica" else None
            limit = COMMAND_TIMEOUT_S if kind == "replica" else None
            for members in layout.all_groups(kind):
                group = maker.make(members, group_backend, limit)
                if rank in members:
                    mine[kind] = group
        world_cpu = maker.make(list(range(world)), "gloo")
        moe = None
        for members in layout.all_groups("replica"):
            group = maker.make(members, None)  # tensor collectives: the default backend
            if rank in members:
                moe = group
        dp_cpu = None
        for members in layout.all_groups("dp"):
            group = maker.make(members, "gloo", COMMAND_TIMEOUT_S)
            if rank in members:
                dp_cpu = group
        fast = _SharedMemoryGroups.open(parallel, world_cpu, rank, timeout_s)
        # dp_group carries no tensor collectives (the DP front uses dp_cpu_group's gloo object calls)
        mine = {kind: group if kind == "dp" else fast.wrap(group, layout.group(kind, rank),
                                                           COMMAND_TIMEOUT_S if kind == "replica" else timeout_s)
                for kind, group in mine.items()}
        moe = fast.wrap(moe, layout.replica_group(rank), timeout_s)
        return cls(
            rank=rank,
            layout=layout,
            backend=backend,
            tp_group=mine["tp"],
            pcp_group=mine["pcp"],
            dcp_group=mine["dcp"],
            cp_group=mine["cp"],
            dp_group=mine["dp"],
            dp_cpu_group=dp_cpu,
            replica_group=mine["replica"],
            world_cpu_group=world_cpu,
            moe_group=moe,
        )


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
