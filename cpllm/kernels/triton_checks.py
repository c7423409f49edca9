"""What the Triton wrappers check before a launch: the slot and length values the kernels follow into memory,
against the pool and the slot table, with the C kernels' errors (checks.py: each names the value and its limit).

A C kernel checks each index in the pass that reads it and returns a status; a Triton kernel returns nothing, so
its wrapper checks the values first, in one fused pass of tensor ops. On CUDA reading that verdict is a device
sync, so a table already checked is not checked again while it is unchanged (`CheckedTables`: the layers of a step
share their tables, and pay one check per step), and nothing is checked while a CUDA graph is being captured (no
value can be read then; a replay reads the tables the runner fills in place, cpllm/model/execution/cuda_graphs.py).
"""

from __future__ import annotations

import weakref

import torch

from cpllm.kernels.checks import length_error, slot_error

INDEX_DTYPES = (torch.int32, torch.int64)
"""Dtypes of the slot tables and lengths the kernels read (the CUDA graphs' static tables are int32)."""

_REMEMBERED = 64
"""Tables CheckedTables remembers: a prefill step reads one per request and layer, a decode step one or a few."""


def _owner(t: torch.Tensor) -> torch.Tensor:
    """The tensor owning `t`'s storage: `t`, or the base it is a view of."""
    return t if t._base is None else t._base


def _identity(t: torch.Tensor) -> tuple:
    """What makes `t`'s values the same as when last checked: its storage's owner, the version counter views share
    with it, and where and how `t` lies in it."""
    return id(_owner(t)), t._version, t.storage_offset(), tuple(t.shape), tuple(t.stride())


class CheckedTables:
    """The tables checked last, by identity and version (weak references: an entry of a freed tensor never
    matches), so the same unchanged table is checked once."""

    __slots__ = ("_seen",)

    def __init__(self) -> None:
        self._seen: dict[tuple, tuple[weakref.ref, ...]] = {}

    def key(self, limits: tuple, tensors: tuple[torch.Tensor, ...]) -> tuple | None:
        """The record of these tensors under these limits; None for an inference tensor (created under
        torch.inference_mode: it has no version counter, so an in-place change could not be seen)."""
        if any(t.is_inference() for t in tensors):
            return None
        return limits + tuple(_identity(t) for t in tensors)

    def seen(self, key: tuple | None, tensors: tuple[torch.Tensor, ...]) -> bool:
        refs = None if key is None else self._seen.get(key)
        return refs is not None and all(ref() is _owner(t) for ref, t in zip(refs, tensors))

    def remember(self, key: tuple | None, tensors: tuple[torch.Tensor, ...]) -> None:
        if key is None:
            return
        if len(self._seen) >= _REMEMBERED:
            del self._seen[next(iter(self._seen))]  # the oldest
        self._seen[key] = tuple(weakref.ref(_owner(t)) for t in tensors)


CHECKED = CheckedTables()
"""The process's record of checked tables (a cache, like the opened libraries of library.py)."""


def _capturing(t: torch.Tensor) -> bool:
    return t.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def check_index_tensor(kernel: str, name: str, t: torch.Tensor, device: torch.device) -> None:
    """`t` holds integers on `device` (what the kernel's pointer arithmetic takes)."""
    if t.dtype not in INDEX_DTYPES:
        raise TypeError(f"{kernel}: {name} must be int32 or int64, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{kernel}: {name} is on {t.device}, the pools on {device}")


def check_decode_tables(kernel: str, slots: torch.Tensor, lengths: torch.Tensor, num_slots: int) -> None:
    """Every length in [0, W] of the slot table slots [B, W], every slot a request reads (slots[b, :lengths[b]])
    in [0, num_slots); padding past a length is never read and may hold anything."""
    if _capturing(slots):
        return
    key = CHECKED.key((kernel, num_slots), (slots, lengths))
    if CHECKED.seen(key, (slots, lengths)):
        return
    width = slots.shape[1]
    bad_length = (lengths < 0) | (lengths > width)  # [B]
    read = torch.arange(width, device=slots.device) < lengths[:, None]  # [B, W]
    bad_slot = read & ((slots < 0) | (slots >= num_slots))  # [B, W]
    if bool(bad_length.any() | bad_slot.any()):  # the one sync of a check on CUDA
        if bool(bad_length.any()):
            raise length_error(kernel, lengths, width)
        raise slot_error(kernel, slots[read], num_slots)
    CHECKED.remember(key, (slots, lengths))


def check_slots(kernel: str, slots: torch.Tensor, num_slots: int) -> None:
    """Every slot of slots [S] (all of them are read) in [0, num_slots)."""
    if _capturing(slots):
        return
    key = CHECKED.key((kernel, num_slots), (slots,))
    if CHECKED.seen(key, (slots,)):
        return
    if bool(((slots < 0) | (slots >= num_slots)).any()):
        raise slot_error(kernel, slots, num_slots)
    CHECKED.remember(key, (slots,))
