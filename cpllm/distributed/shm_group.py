"""Collectives through shared memory between the ranks of a group that share one host (the CPU fast path).

gloo moves every collective through loopback TCP, and each hop waits for the kernel to wake a blocked
reader: on a small VM a 2-rank all-reduce of a few KB takes about 1.4 ms, which decode pays once or twice
per layer. Here the group's ranks map one file under /dev/shm. Each rank owns two slots (a double buffer)
and a sequence number. A collective copies this rank's part into its slot for this sequence number,
publishes the number, spins until every member has published it, and reads the others' slots: about 20 us.

Ordering: the flag is stored after the data, and x86 makes stores visible in program order (TSO) and
keeps loads in order, so a reader that sees the flag sees the data. `available()` is False elsewhere,
and those hosts keep gloo.

Why two slots suffice: a rank publishes sequence s only after it finished reading every slot of s - 1,
and it returns from s - 1 only once every member published s - 1, i.e. had finished reading s - 2. So
when a rank writes the slot of parity s % 2 for s, nobody still reads that slot's previous use (s - 2).

Bounded waits, as with gloo: a wait longer than the group's timeout raises, naming the ranks that never
arrived; a member process that has exited (or is a zombie) is noticed within POLL_S and raises, naming it.
A payload larger than a slot goes through the group's gloo process group instead (every member sees the
same size, so all take the same path).
"""

from __future__ import annotations

import math
import mmap
import os
import pickle
import platform
import time
import uuid
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

SHM_DIR = "/dev/shm"
SLOT_BYTES = 32 << 20
"""Bytes per slot (two per rank); bigger payloads take gloo. A PCP rank's new K and V of a 16K-token SmolLM2 prompt
(12 MiB) fit in one exchange; the file's pages are only taken as payloads touch them."""
MIN_SLOT_BYTES = 64 << 10
"""Below this (a nearly full /dev/shm) the group keeps gloo."""
HEADER_BYTES = 4096
"""The sequence flags, one int64 per rank, padded to a page."""
SPIN_S = 0.002
"""Busy-wait this long (peers in step arrive within microseconds), then yield the core between checks."""
SLEEP_S = 0.0002
"""Sleep between checks once a wait is long (a peer still computing)."""
IDLE_S = 1.0
"""After this long (an idle worker waiting for the next step), sleep IDLE_SLEEP_S between checks."""
IDLE_SLEEP_S = 0.002
POLL_S = 0.05
"""How often a long wait checks the clock against the timeout and that every peer process lives."""

_REDUCE = {
    dist.ReduceOp.SUM: torch.Tensor.add_,
    dist.ReduceOp.MIN: lambda acc, x: torch.minimum(acc, x, out=acc),
    dist.ReduceOp.MAX: lambda acc, x: torch.maximum(acc, x, out=acc),
}


def available() -> bool:
    """Shared memory collectives are sound here: x86 memory ordering, Linux /dev/shm and /proc."""
    machine = platform.machine().lower()
    return machine in ("x86_64", "amd64") and os.path.isdir(SHM_DIR) and os.path.isdir("/proc")


def host_key() -> str:
    """Same string on two processes exactly when they share a machine (hostname and kernel boot id)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{platform.node()}/{boot}"


def _process_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X", "x")


class ShmGroup:
    """A process group of ranks on one host, with its collectives through a shared mapping.

    Pass it wherever a group goes: `cpllm.distributed.comm` sends what fits through the mapping and the
    rest (ring transfers, all-to-all, oversized payloads) through `process_group`.
    """

    def __init__(self, process_group: dist.ProcessGroup, members: list[int], rank: int, pids: list[int],
                 mapping: mmap.mmap, slot_bytes: int, timeout_s: float):
        self.process_group = process_group
        """The gloo group of the same ranks (fallback, and for what has no shared-memory form)."""
        self.members = members
        """Global ranks, in group-rank order."""
        self.rank = members.index(rank)
        """This process's group rank."""
        self.size = len(members)
        self.pids = pids
        """Process id of each member, for the liveness check."""
        self.slot_bytes = slot_bytes
        self.timeout_s = timeout_s
        self._mapping = mapping
        self._flags = np.frombuffer(mapping, dtype=np.int64, count=self.size)
        self._base = torch.frombuffer(mapping, dtype=torch.uint8)
        # [parity][group rank] -> that rank's slot
        self._slots = [[self._base[self._offset(p, r): self._offset(p, r) + slot_bytes] for r in range(self.size)]
                       for p in range(2)]
        self._seq = 0

    def _offset(self, parity: int, group_rank: int) -> int:
        return HEADER_BYTES + (parity * self.size + group_rank) * self.slot_bytes

    def fits(self, nbytes: int) -> bool:
        return nbytes <= self.slot_bytes

    # ---- the one synchronisation primitive ------------------------------------------------------------

    def _exchange(self, payload: torch.Tensor | None, what: str) -> list[torch.Tensor]:
        """Write `payload` (any dtype and strides, may be None) to this rank's slot, wait for every member; returns
        all slots (uint8)."""
        seq, parity = self._next()
        if payload is not None:  # one copy straight from the payload's strides (a view of fused q|k|v rows)
            slot = self._slots[parity][self.rank][: payload.numel() * payload.element_size()]
            slot.view(payload.dtype).view(payload.shape).copy_(payload)
        self._arrive(seq, what)
        return self._slots[parity]

    def _next(self) -> tuple[int, int]:
        """The next exchange's sequence number and the parity of the slots it writes."""
        self._seq += 1
        return self._seq, self._seq % 2

    def _arrive(self, seq: int, what: str) -> None:
        """Say this rank's writes of exchange `seq` are done, then wait for every member's."""
        self._flags[self.rank] = seq
        self._wait(seq, what)

    def _wait(self, seq: int, what: str) -> None:
        flags = self._flags
        if flags.min() >= seq:
            return
        start = time.monotonic()
        next_poll = start + POLL_S
        while flags.min() < seq:
            now = time.monotonic()
            waited = now - start
            if waited > IDLE_S:
                time.sleep(IDLE_SLEEP_S)
            elif waited > 10 * SPIN_S:
                time.sleep(SLEEP_S)
            elif waited > SPIN_S:
                os.sched_yield()
            if now >= next_poll:
                next_poll = now + POLL_S
                self._check_peers(seq, what, now - start)

    def _check_peers(self, seq: int, what: str, waited_s: float) -> None:
        problem = self.wait_problem([r for r in range(self.size) if self._flags[r] < seq], what, waited_s)
        if problem is not None:
            raise RuntimeError(problem)

    def wait_problem(self, missing: list[int], what: str, waited_s: float) -> str | None:
        """Why a wait for group ranks `missing` must stop (one of them exited, or it outlasted the timeout)."""
        dead = [self.members[r] for r in missing if not _process_alive(self.pids[r])]
        if dead:
            return f"shared-memory {what}: rank(s) {dead} of group {self.members} exited"
        if waited_s > self.timeout_s:
            return (f"shared-memory {what}: timed out after {self.timeout_s:g} s waiting for rank(s) "
                    f"{[self.members[r] for r in missing]} of group {self.members}")
        return None

    def map_buffer(self, nbytes: int) -> mmap.mmap | None:
        """A zeroed mapping of `nbytes` that every member shares (called by all); None on all when /dev/shm has no
        room for it."""
        path = _create_sized(nbytes) if self.rank == 0 else None
        path = self.broadcast_object(path, self.members[0])
        if path is None:
            return None
        fd = os.open(path, os.O_RDWR)
        try:
            mapping = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        self._exchange(None, "map_buffer")  # every member has mapped it
        if self.rank == 0:
            os.unlink(path)  # as in open_shm_group: nothing is left behind
        return mapping

    # ---- collectives ----------------------------------------------------------------------------------

    def _parts(self, tensor: torch.Tensor, what: str) -> list[torch.Tensor]:
        """Every member's `tensor` (same shape and dtype on all), as views of the slots, in group-rank order."""
        nbytes = tensor.numel() * tensor.element_size()
        slots = self._exchange(tensor, what)
        return [slots[r][:nbytes].view(tensor.dtype).view(tensor.shape) for r in range(self.size)]

    def fits_rows(self, tensors: tuple[torch.Tensor, ...], total_rows: int) -> bool:
        """Whether `gather_rows`' buffers of `total_rows` rows of each of `tensors` fit one parity's slots."""
        return _row_buffers(tensors, total_rows)[1] <= self.size * self.slot_bytes

    def gather_rows(self, tensors: tuple[torch.Tensor, ...], placements: list[tuple[int, int, int]],
                    total_rows: int) -> tuple[torch.Tensor, ...]:
        """comm.all_gather_rows on one host: the buffers laid over one parity's slots of every member (contiguous in
        the mapping), each member writing its rows at their places; views, valid until this rank's next exchange.
        The parity's slots are free when this rank writes: every member has finished its exchange before (each
        copies out what it keeps before its next collective), as for `_exchange`."""
        seq, parity = self._next()
        region = self._base[self._offset(parity, 0): self._offset(parity, self.size)]
        offsets, _ = _row_buffers(tensors, total_rows)
        buffers = tuple(region[o: o + total_rows * _row_bytes(t)].view(t.dtype).view(total_rows, *t.shape[1:])
                        for t, o in zip(tensors, offsets))
        for tensor, buffer in zip(tensors, buffers):
            for src, dst, length in placements:
                buffer[dst: dst + length].copy_(tensor[src: src + length])
        self._arrive(seq, "all_gather_rows")
        return buffers

    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Every member's equal-shaped tensor concatenated along `dim`, in group-rank order."""
        return torch.cat(self._parts(tensor, "all_gather"), dim=dim)

    def all_reduce_(self, tensor: torch.Tensor, op) -> torch.Tensor:
        """Reduce in place, in group-rank order, so every member gets the same bits."""
        parts = self._parts(tensor, "all_reduce")
        reduce = _REDUCE[op]
        acc = parts[0].clone()
        for part in parts[1:]:
            reduce(acc, part)
        tensor.copy_(acc)
        return tensor

    def broadcast_object(self, obj: Any, src: int) -> Any:
        """`obj` pickled on global rank `src`, returned on every member (gloo when it outgrows a slot)."""
        src_rank = self.members.index(src)
        payload = None
        if self.rank == src_rank:
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            size = len(data) if len(data) + 8 <= self.slot_bytes else -1
            header = torch.tensor([size], dtype=torch.int64).view(torch.uint8)
            payload = header if size < 0 else torch.cat([header, torch.frombuffer(bytearray(data), dtype=torch.uint8)])
        slot = self._exchange(payload, "broadcast")[src_rank]
        size = int(slot[:8].view(torch.int64)[0])
        if size < 0:
            box = [obj]
            dist.broadcast_object_list(box, src=src, group=self.process_group)
            return box[0]
        if self.rank == src_rank:
            return obj
        return pickle.loads(slot[8: 8 + size].numpy().tobytes())


def open_shm_group(process_group: dist.ProcessGroup, members: list[int], rank: int,
                   timeout_s: float) -> ShmGroup | None:
    """Called by every member: map one shared file (group rank 0 creates it); None = keep gloo (no room)."""
    creator = members[0]
    path = None
    slot_bytes = 0
    if rank == creator:
        path, slot_bytes = _create_file(len(members))
    box = [(path, slot_bytes)]
    dist.broadcast_object_list(box, src=creator, group=process_group)
    path, slot_bytes = box[0]
    if path is None:
        return None
    fd = os.open(path, os.O_RDWR)
    try:
        mapping = mmap.mmap(fd, HEADER_BYTES + 2 * len(members) * slot_bytes)
    finally:
        os.close(fd)
    pids: list[Any] = [None] * len(members)
    dist.all_gather_object(pids, os.getpid(), group=process_group)  # also: every member has mapped it
    if rank == creator:
        os.unlink(path)  # the mappings stay valid; nothing is left behind if a process dies
    return ShmGroup(process_group, members, rank, pids, mapping, slot_bytes, timeout_s)


def _row_bytes(tensor: torch.Tensor) -> int:
    """Bytes of one row (dim 0) of `tensor`."""
    return math.prod(tensor.shape[1:]) * tensor.element_size()


def _row_buffers(tensors: tuple[torch.Tensor, ...], total_rows: int) -> tuple[list[int], int]:
    """Byte offset of each tensor's [total_rows, ...] buffer in a parity's slots, each on a 64-byte boundary, and
    the bytes they take in all."""
    offsets, end = [], 0
    for tensor in tensors:
        offsets.append(end)
        end += -(-total_rows * _row_bytes(tensor) // 64) * 64
    return offsets, end


def _create_file(size: int) -> tuple[str | None, int]:
    """A zeroed file sized for `size` ranks' double slots, shrunk to fit /dev/shm's free space."""
    slot_bytes = SLOT_BYTES
    while slot_bytes >= MIN_SLOT_BYTES:
        path = _create_sized(HEADER_BYTES + 2 * size * slot_bytes)
        if path is not None:
            return path, slot_bytes
        slot_bytes //= 2
    return None, 0


def _create_sized(nbytes: int) -> str | None:
    """A zeroed file of `nbytes` under /dev/shm, or None when that would take over a quarter of its free space."""
    try:
        stat = os.statvfs(SHM_DIR)
    except OSError:
        return None
    if nbytes > stat.f_bavail * stat.f_frsize // 4:
        return None
    path = os.path.join(SHM_DIR, f"cpllm-{os.getpid()}-{uuid.uuid4().hex[:12]}")
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError:
        return None
    try:
        os.ftruncate(fd, nbytes)
    except OSError:
        os.close(fd)
        os.unlink(path)
        return None
    os.close(fd)
    return path
