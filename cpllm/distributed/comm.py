"""Thin collective helpers that take their group explicitly.

A group is a `ProcessGroup` or `None`; `None` is a group of one rank (see
`cpllm.distributed.groups`), and every helper returns at once for it, so layers
call them unconditionally. Ranks passed in (`src`) are GLOBAL ranks, as in
torch.distributed.

Every collective here is bounded: the timeout given to `init_process_group` /
`new_group` applies to each gloo operation, and a peer process that has died
closes its sockets, which makes the surviving ranks' gloo calls raise at once
(tests/test_launch.py checks both cases). A call never hangs forever, except on
the control groups (`groups.COMMAND_TIMEOUT_S`), which wait for the next step or tick
and fail only when a peer dies.

A group may also be a `ShmGroup` (ranks on one host, `cpllm.distributed.shm_group`): the helpers send
what fits its slots through shared memory, with the same timeout and a dead-peer check, and the rest
through its gloo process group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from cpllm.distributed.shm_group import ShmGroup

Group = dist.ProcessGroup | ShmGroup | None


def process_group(group: Group) -> dist.ProcessGroup | None:
    """The torch process group behind `group` (for calls that have no shared-memory form)."""
    return group.process_group if isinstance(group, ShmGroup) else group


def group_size(group: Group) -> int:
    if isinstance(group, ShmGroup):
        return group.size
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Group) -> int:
    """This process's rank inside the group (0 for a group of one)."""
    if isinstance(group, ShmGroup):
        return group.rank
    return 0 if group is None else dist.get_rank(group)


def low_latency(group: Group) -> bool:
    """Collectives on `group` take microseconds (shared memory, NCCL, or a group of one), not a TCP round trip:
    worth adding a few per layer to split work that would otherwise be computed twice."""
    if group is None or isinstance(group, ShmGroup):
        return True
    return str(dist.get_backend(group)) == "nccl"


def _shm_for(group: Group, tensor: torch.Tensor) -> ShmGroup | None:
    """The shared-memory path when `group` has one and `tensor` fits a slot."""
    if isinstance(group, ShmGroup) and group.fits(tensor.numel() * tensor.element_size()):
        return group
    return None


def all_gather_rows(tensors: tuple[torch.Tensor, ...], placements: list[tuple[int, int, int]], total_rows: int,
                    group: Group) -> tuple[torch.Tensor, ...] | None:
    """Every rank's rows of `tensors` gathered straight into their places: this rank's rows [src, src + n) of each
    tensor land at rows [dst, dst + n) of a shared [total_rows, ...] buffer (`placements`: (src, dst, n)), the
    ranks' rows together filling it. Views of one host's shared memory, valid until this rank's next collective on
    `group` (copy out what is kept); None where that path is not open (a group of one, no shared memory, buffers
    past its slots): the same on every rank of the group, so all of them take the same collectives."""
    if group_size(group) == 1 or not isinstance(group, ShmGroup):
        return None
    if not group.fits_rows(tensors, total_rows):
        return None
    return group.gather_rows(tensors, placements, total_rows)


def all_gather(tensor: torch.Tensor, group: Group, *, dim: int = 0) -> torch.Tensor:
    """Concatenate every rank's tensor along `dim`, in group-rank order.

    Every rank must pass the same shape (gloo cannot gather unequal sizes: pad,
    or use `all_to_all` with split sizes).
    """
    world = group_size(group)
    if world == 1:
        return tensor
    if tensor.dim() == 0:
        raise ValueError("all_gather needs a tensor with at least one dimension")
    # gloo's all_gather_into_tensor gathers contiguous buffers along dim 0 only.
    dim = dim % tensor.dim()
    shm = _shm_for(group, tensor)
    if shm is not None:
        return shm.all_gather(tensor, dim)
    shape = tensor.shape
    out = torch.empty((world * shape[0], *shape[1:]), dtype=tensor.dtype, device=tensor.device)
    dist.all_gather_single(out, tensor.contiguous(), group=process_group(group))
    if dim == 0:
        return out
    # [world, *shape] -> shape with dim scaled by world, rank r's slice at r * shape[dim]
    return out.view(world, *shape).movedim(0, dim).flatten(dim, dim + 1)


def all_reduce(
    tensor: torch.Tensor, group: Group, *, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
) -> torch.Tensor:
    """Reduce in place over the group; returns the same tensor."""
    if group_size(group) == 1:
        return tensor
    shm = _shm_for(group, tensor)
    if shm is not None:
        return shm.all_reduce_(tensor, op)
    dist.all_reduce(tensor, op=op, group=process_group(group))
    return tensor


def reduce_scatter(tensor: torch.Tensor, group: Group, *, dim: int = 0) -> torch.Tensor:
    """Sum over the group, then keep this rank's equal slice of `dim` (group-rank order)."""
    world = group_size(group)
    if world == 1:
        return tensor
    dim = dim % tensor.dim()
    if tensor.shape[dim] % world != 0:
        raise ValueError(
            f"reduce_scatter: size {tensor.shape[dim]} of dim {dim} is not divisible by group size {world}"
        )
    inp = tensor.movedim(dim, 0).contiguous()  # [world * chunk, ...rest]
    out = torch.empty((inp.shape[0] // world, *inp.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    dist.reduce_scatter_tensor(out, inp, group=process_group(group))
    return out.movedim(0, dim)


def all_to_all(
    tensor: torch.Tensor,
    group: Group,
    *,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
) -> torch.Tensor:
    """Exchange slices of dim 0: slice i of the input goes to group rank i.

    `input_split_sizes[i]` rows go to rank i; `output_split_sizes[i]` rows come
    from rank i (None = equal split). Unlike all_gather, sizes may differ.
    """
    world = group_size(group)
    if world == 1:
        return tensor
    named = (("input_split_sizes", input_split_sizes), ("output_split_sizes", output_split_sizes))
    for name, splits in named:
        if splits is not None and len(splits) != world:
            raise ValueError(f"all_to_all: {name} has {len(splits)} entries for a group of {world}")
    if input_split_sizes is not None and sum(input_split_sizes) != tensor.shape[0]:
        raise ValueError(
            f"all_to_all: input_split_sizes sum to {sum(input_split_sizes)}, dim 0 is {tensor.shape[0]}"
        )
    rows = tensor.shape[0] if output_split_sizes is None else sum(output_split_sizes)
    out = torch.empty((rows, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    dist.all_to_all_single(
        out,
        tensor.contiguous(),
        output_split_sizes=output_split_sizes,
        input_split_sizes=input_split_sizes,
        group=process_group(group),
    )
    return out


def broadcast_object(obj: Any, *, src: int, group: Group) -> Any:
    """Pickle `obj` on global rank `src` and return it on every rank of `group`.

    Use a gloo group (ParallelGroups.replica_group / world_cpu_group): the object
    travels as a CPU byte tensor, so control messages never touch the GPU.
    Non-source ranks may pass anything (it is ignored).
    """
    if group_size(group) == 1:
        return obj
    if isinstance(group, ShmGroup):
        return group.broadcast_object(obj, src)
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


@dataclass(kw_only=True, slots=True)
class RingTransfer:
    """An in-flight ring step; `wait()` returns the tensor received from the previous rank."""

    received: torch.Tensor
    """Buffer the previous rank's tensor lands in (valid only after wait())."""
    sent: torch.Tensor | None
    """The outgoing buffer, kept alive until the send completes."""
    works: list[Any]
    """Work handles of the send and the receive."""

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        self.works = []
        self.sent = None
        return self.received


def ring_exchange(
    tensor: torch.Tensor, group: Group, *, recv_buffer: torch.Tensor | None = None
) -> RingTransfer:
    """Start sending `tensor` to the next group rank and receiving the previous one's.

    Non-blocking (batch_isend_irecv), so compute can overlap the transfer; every
    rank of the group must call it with the same shape. After `world - 1` steps
    each rank has seen every rank's tensor. For a group of one, the "previous
    rank" is this rank, so the tensor itself comes back.
    """
    world = group_size(group)
    if world == 1:
        return RingTransfer(received=tensor, sent=None, works=[])
    group = process_group(group)
    me = dist.get_rank(group)
    next_rank = dist.get_global_rank(group, (me + 1) % world)
    prev_rank = dist.get_global_rank(group, (me - 1) % world)
    if recv_buffer is None:
        recv_buffer = torch.empty_like(tensor, memory_format=torch.contiguous_format)
    elif (
        recv_buffer.shape != tensor.shape
        or recv_buffer.dtype != tensor.dtype
        or not recv_buffer.is_contiguous()
    ):
        raise ValueError(
            f"ring_exchange: recv_buffer {tuple(recv_buffer.shape)} {recv_buffer.dtype} does not match "
            f"tensor {tuple(tensor.shape)} {tensor.dtype} (it must also be contiguous)"
        )
    sent = tensor.contiguous()
    ops = [
        dist.P2POp(dist.isend, sent, next_rank, group),
        dist.P2POp(dist.irecv, recv_buffer, prev_rank, group),
    ]
    return RingTransfer(received=recv_buffer, sent=sent, works=dist.batch_isend_irecv(ops))
