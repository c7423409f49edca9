"""The fused decode layer's step arguments (cpllm/kernels/decode_layer.c), checked before C follows them.

cpllm/model/fused_decode.py packs each layer's weights once (LayerSpec) and calls the layer function per layer;
`step_spec` builds the one StepSpec a step's layers share, after the O(1) checks of what the C code trusts about
the tensors it points into (dtype, contiguity, batch sizes that agree). The indices' values are checked in C as
the kernels read them (kernel_status.h), and `checks.decode_layer_error` names a bad one.
"""

from __future__ import annotations

import torch

from cpllm.kernels.decode_attention import POOL_DTYPES, positions_per_unit
from cpllm.kernels.structs import StepSpec


def _indices(name: str, t: torch.Tensor, dim: int) -> None:
    if t.dtype != torch.long or not t.is_contiguous() or t.dim() != dim:
        raise ValueError(f"fused decode layer: {name} must be a contiguous {dim}-d int64 tensor, not "
                         f"{t.dtype} {tuple(t.shape)}")


def step_spec(tables: tuple[torch.Tensor, torch.Tensor], write_rows: torch.Tensor, write_slots: torch.Tensor,
              slots: torch.Tensor, lengths: torch.Tensor, pool: torch.Tensor, threads: int) -> StepSpec:
    """The StepSpec of a step of `slots.shape[0]` single tokens: rotary tables cos, sin [B, 1, D] float32, the
    new K/V rows write_rows [W] into write_slots [W], request b's context slots[b, :lengths[b]] of slots [B, width],
    and `pool` one layer's K pool [num_slots, Hkv, D] (every layer's pools have its shape). The tensors must stay
    alive while the step runs."""
    cos, sin = tables
    for name, t, dim in (("write_rows", write_rows, 1), ("write_slots", write_slots, 1), ("slots", slots, 2),
                         ("lengths", lengths, 1)):
        _indices(name, t, dim)
    batch, width = slots.shape
    if lengths.shape[0] != batch or write_rows.shape != write_slots.shape:
        raise ValueError(f"fused decode layer: slots {tuple(slots.shape)}, lengths {tuple(lengths.shape)}, "
                         f"write_rows {tuple(write_rows.shape)}, write_slots {tuple(write_slots.shape)} disagree")
    if cos.shape != sin.shape or cos.shape[0] != batch or cos.dtype != torch.float32 or sin.dtype != torch.float32 \
            or not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError(f"fused decode layer: rotary tables {tuple(cos.shape)} {cos.dtype}, {tuple(sin.shape)} "
                         f"{sin.dtype} are not contiguous float32 of the batch's {batch} rows")
    return StepSpec(batch, cos.data_ptr(), sin.data_ptr(), write_rows.data_ptr(), write_slots.data_ptr(),
                    write_slots.shape[0], slots.data_ptr(), lengths.data_ptr(), width, POOL_DTYPES[pool.dtype],
                    positions_per_unit(batch, width, threads), threads, pool.shape[0])
