"""The PCP ranks of one host running each decode step's fused layers together (cpllm/kernels/decode_team.h).

Decode under PCP holds the same single tokens on every PCP rank. Alone, each rank would stream all of the weights
for them (a batch-1 step is bound by that stream) and the sharded layout would add a few collectives per layer.
As a team, the members divide every linear's output columns and the context (the sharded layout: each its KV
shard; the replicated layout: each its part of every request's context), and meet at five shared-memory barriers
per layer (about 0.3 ms of waiting per batch-1 step of SmolLM2, all 150 together). The buffers live in one mapping
of the PCP group's shared-memory transport (`ShmGroup.map_buffer`), so a team exists only where that transport
does, and only where every thread of this host's ranks has a core: a member spinning for a peer that waits for a
core would hold that core in its place.

With tensor parallelism (and PCP = 1) the team is the TP group instead: each rank keeps its weight shards and
computes its heads and intermediate columns, and what the eager layers all-reduce (the output and down projections'
partial sums) and, under DCP, all-gather and merge (each DCP group's queries and attention parts) goes through the
same kind of shared buffers and barriers (cpllm/kernels/decode_layer_tp.h): two barriers per layer, four with DCP.

A wait that lasts goes back to Python every 50 ms: `ShmGroup.wait_problem` (the group's timeout, a member process
that has exited) decides whether to give up, and the step then raises its message, as the group's own collectives
do.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import torch

from cpllm.distributed.shm_group import ShmGroup
from cpllm.kernels.structs import TeamCheck, TeamSpec

FLAG_STRIDE = 8
"""int64s between members' flags (decode_team.h's TEAM_FLAG_STRIDE)."""
ALIGN = 64


@dataclass(frozen=True)
class TeamShapes:
    """What the shared buffers must hold per decode row."""

    hidden: int
    qkv_width: int
    """(query heads + 2 KV heads) x head dim."""
    heads: int
    head_dim: int
    intermediate: int


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _buffer_bytes(shapes: TeamShapes, max_batch: int, size: int, tensor_parallel: bool, dcp: int) -> list[int]:
    """Bytes of the mapping's buffers, in TeamSpec's order: flags, qkv, partials, lses, hidden_part, gate_up, sums,
    q_group (a buffer the team's kind does not use takes none)."""
    rows, f32 = max_batch, 4
    flags = size * FLAG_STRIDE * 8
    if not tensor_parallel:  # every member the whole heads: columns of each linear, one attention part each
        return [flags, rows * shapes.qkv_width * f32, rows * size * shapes.heads * shapes.head_dim * f32,
                rows * size * shapes.heads * f32, rows * shapes.hidden * f32, rows * 2 * shapes.intermediate * f32,
                0, 0]
    group_heads = dcp * shapes.heads  # each member attends its DCP group's heads to its shard
    attention = [rows * size * group_heads * shapes.head_dim * f32, rows * size * group_heads * f32] if dcp > 1 \
        else [0, 0]
    q_group = rows * size * shapes.heads * shapes.head_dim * f32 if dcp > 1 else 0
    return [flags, 0, *attention, 0, 0, 2 * size * rows * shapes.hidden * f32, q_group]


class DecodeTeam:
    """This rank's member of its decode team (PCP or TP group): the shared buffers and the barrier's state."""

    def __init__(self, group: ShmGroup, mapping, spec: TeamSpec, split_context: bool, tensor_parallel: bool):
        self.group, self._mapping, self.spec = group, mapping, spec
        self.size, self.member = group.size, group.rank
        self.max_batch = spec.max_batch
        """Most rows a step the team runs may have (its buffers' size; the step plans read it: plan.py)."""
        self.split_context = split_context
        """Replicated layout: every member holds the whole context and attends its part of each request's."""
        self.tensor_parallel = tensor_parallel
        """The members are TP ranks, each with its shard of the weights (decode_layer_tp.h); else PCP ranks."""
        self.error: str | None = None
        """Why the last wait was given up (set by the check the C barrier calls)."""
        self._check = TeamCheck(self._check_wait)  # kept: the C side holds its address
        spec.check = self._check

    @classmethod
    def open(cls, group, shapes: TeamShapes, max_batch: int, split_context: bool, busy_threads: int,
             tensor_parallel: bool = False, dcp: int = 1) -> "DecodeTeam | None":
        """Called by every rank of `group` alike: the team over it, or None on all where there is no shared-memory
        transport, no room for the buffers, or fewer cores than `busy_threads` (every rank's threads on this host:
        a member waiting for one that has no core would spin in its place). `tensor_parallel`: `group` is the TP
        group (PCP = 1), its consecutive ranks in DCP groups of `dcp`; `shapes` are then one rank's shards."""
        if not isinstance(group, ShmGroup) or group.size < 2:
            return None
        cores = len(os.sched_getaffinity(0))
        if not group.broadcast_object(busy_threads <= cores, group.members[0]):  # group rank 0 decides for all
            return None
        sizes = _buffer_bytes(shapes, max_batch, group.size, tensor_parallel, dcp)
        offsets = [0]
        for size in sizes:
            offsets.append(offsets[-1] + _aligned(size))
        mapping = group.map_buffer(offsets[-1])
        if mapping is None:
            return None
        base = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
        flags, qkv, partials, lses, hidden_part, gate_up, sums, q_group = (base + o for o in offsets[:-1])
        spec = TeamSpec(flags, qkv, partials, lses, hidden_part, gate_up, max_batch, group.rank, group.size, 0,
                        TeamCheck(), sums, q_group, dcp)
        return cls(group, mapping, spec, split_context, tensor_parallel)

    def _check_wait(self, waited_s: float) -> int:
        flags = (ctypes.c_int64 * (self.size * FLAG_STRIDE)).from_address(self.spec.flags)
        missing = [r for r in range(self.size) if flags[r * FLAG_STRIDE] < self.spec.seq]
        self.error = self.group.wait_problem(missing, "decode team barrier", waited_s)
        return 1 if self.error is not None else 0

    def context_part(self, slots: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This member's contiguous part of each request's context (replicated layout): (slots [B, width], lengths
        [B]), member m taking positions [L m / P, L (m + 1) / P) of a context of L."""
        first = lengths * self.member // self.size
        count = lengths * (self.member + 1) // self.size - first
        width = max(int(count.max()), 1)
        index = (first[:, None] + torch.arange(width)).clamp_(max=max(slots.shape[1] - 1, 0))
        return torch.gather(slots, 1, index), count

    def describe(self) -> str:
        if self.tensor_parallel:
            return (f"the {self.size} TP ranks decode as one team (each its weight shards; partial sums, and with "
                    f"DCP the attention parts, meet in shared memory, not collectives; up to {self.max_batch} rows)")
        return (f"the {self.size} PCP ranks decode as one team (each computes 1/{self.size} of every linear's "
                f"outputs and of the attention; shared-memory barriers, up to {self.max_batch} rows)")

