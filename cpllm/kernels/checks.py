"""The errors a kernel's nonzero status becomes (kernel_status.h), each naming the offending value and its limit.

The kernels check the indices they follow into memory in C, in the pass that already reads them, and return a
status; only then, on the error path, does Python look for the value to name.
"""

from __future__ import annotations

import ctypes

import torch

from cpllm.kernels.structs import StepSpec

OK, NO_MEMORY, TEAM_ABORTED, SLOT_OUT_OF_RANGE, LENGTH_OUT_OF_RANGE, ROW_OUT_OF_RANGE, UNSUPPORTED_SHAPE = \
    0, -1, -2, -3, -4, -5, -6
"""kernel_status.h's codes."""


def _first_outside(values: torch.Tensor, limit: int, upper_inclusive: bool = False) -> tuple[int, int] | None:
    """(position, value) of the first of `values` (flattened) outside [0, limit) ([0, limit] if inclusive)."""
    flat = values.reshape(-1)
    outside = (flat < 0) | ((flat > limit) if upper_inclusive else (flat >= limit))
    found = outside.nonzero()
    if found.numel() == 0:
        return None
    at = int(found[0, 0])
    return at, int(flat[at])


def _read_slots(slots: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The slots a decode kernel reads: slots[b, :lengths[b]] of slots [B, W], flattened."""
    return slots[torch.arange(slots.shape[1]) < lengths[:, None]]


def check_shape(kernel: str, ok: bool, what: str) -> None:
    """Raise ValueError `kernel: what` unless ok (an O(1) check of shapes the C code trusts)."""
    if not ok:
        raise ValueError(f"{kernel}: {what}")


def slot_error(kernel: str, slots: torch.Tensor, num_slots: int, kind: str = "slot") -> IndexError:
    found = _first_outside(slots, num_slots)
    value = "?" if found is None else found[1]
    return IndexError(f"{kernel}: {kind} {value} out of range: the pool has {num_slots} slots")


def row_error(kernel: str, rows: torch.Tensor, num_rows: int) -> IndexError:
    found = _first_outside(rows, num_rows)
    value = "?" if found is None else found[1]
    return IndexError(f"{kernel}: source row {value} out of range: the step has {num_rows} rows")


def length_error(kernel: str, lengths: torch.Tensor, width: int) -> ValueError:
    found = _first_outside(lengths, width, upper_inclusive=True)
    request, value = ("?", "?") if found is None else found
    return ValueError(f"{kernel}: context length {value} of request {request} out of range: the slot table holds "
                      f"{width} slots per request")


def decode_attention_error(status: int, slots: torch.Tensor, lengths: torch.Tensor, num_slots: int) -> Exception:
    """What cpllm_paged_decode_attention's status means, for slots [B, W], lengths [B]."""
    kernel = "decode attention"
    if status == LENGTH_OUT_OF_RANGE:
        return length_error(kernel, lengths, slots.shape[1])
    if status == SLOT_OUT_OF_RANGE:
        return slot_error(kernel, _read_slots(slots, lengths), num_slots)
    return MemoryError(f"{kernel} kernel could not allocate its buffers (status {status}, batch {slots.shape[0]})")


def store_rows_error(status: int, slots: torch.Tensor, rows: torch.Tensor, num_slots: int,
                     num_rows: int) -> Exception:
    """What cpllm_store_rows' status means."""
    if status == ROW_OUT_OF_RANGE:
        return row_error("K/V store", rows, num_rows)
    if status == SLOT_OUT_OF_RANGE:
        return slot_error("K/V store", slots, num_slots)
    return RuntimeError(f"K/V store kernel failed (status {status})")


def _int64s(address: int, count: int) -> torch.Tensor:
    """A copy of `count` int64s at `address` (what a StepSpec points to)."""
    if count <= 0:
        return torch.zeros(0, dtype=torch.long)
    return torch.tensor((ctypes.c_int64 * count).from_address(address)[:], dtype=torch.long)


def decode_layer_error(status: int, spec: StepSpec) -> Exception:
    """What a fused decode layer's status (other than a team's abort) means for the step `spec` describes."""
    kernel = "fused decode layer"
    if status == NO_MEMORY:
        return MemoryError(f"{kernel} could not allocate its buffers (batch {spec.batch})")
    if status == UNSUPPORTED_SHAPE:
        return ValueError(f"{kernel}: a head size the rotary kernel does not take (even, at most 512)")
    if status == ROW_OUT_OF_RANGE:
        return row_error(kernel, _int64s(spec.write_rows, spec.writes), spec.batch)
    lengths = _int64s(spec.lengths, spec.batch)
    if status == LENGTH_OUT_OF_RANGE:
        return length_error(kernel, lengths, spec.slot_stride)
    if status == SLOT_OUT_OF_RANGE:
        writes = _int64s(spec.write_slots, spec.writes)
        if _first_outside(writes, spec.num_slots) is not None:
            return slot_error(kernel, writes, spec.num_slots, kind="write slot")
        slots = _int64s(spec.slots, spec.batch * spec.slot_stride).view(spec.batch, spec.slot_stride)
        return slot_error(kernel, _read_slots(slots, lengths), spec.num_slots)
    return RuntimeError(f"{kernel} failed (status {status})")
