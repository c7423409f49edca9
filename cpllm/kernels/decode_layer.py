"""The fused decode layer's arguments (cpllm/kernels/decode_layer.c), checked before C follows them.

cpllm/model/execution/fused_decode.py packs each layer's weights once (`layer_spec`: every weight's shape checked against the
layer's sizes, at load) and calls the layer function per layer; `step_spec` builds the one StepSpec a step's layers
share, after the O(1) checks of what the C code trusts about the tensors it points into (dtype, contiguity, batch
sizes that agree). The indices' values are checked in C as the kernels read them (kernel_status.h), and
`checks.decode_layer_error` names a bad one.
"""

from __future__ import annotations

import torch

from cpllm.config.engine import QUANT_GROUP
from cpllm.kernels.decode_attention import POOL_DTYPES, positions_per_unit
from cpllm.kernels.int4_matmul import BLOCK_ROWS
from cpllm.kernels.structs import LINEAR_F32, LINEAR_INT4, LayerSpec, LinearSpec, StepSpec

MAX_HEAD_DIM = 512
"""Widest head the rotary kernel's buffer holds (decode_rows.c)."""


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


def _packed_shape(kind: int, inputs: int, outputs: int) -> tuple[int, ...]:
    """The shape a weight of `kind` for inputs -> outputs has: int4_matmul.pack's blocks, or float32 [in, out]."""
    if kind == LINEAR_INT4:
        return -(-outputs // BLOCK_ROWS), inputs // QUANT_GROUP, 320
    return inputs, outputs


def layer_spec(norms: tuple[torch.Tensor, torch.Tensor], linears: list[tuple[int, torch.Tensor]], heads: int,
               kv_heads: int, head_dim: int, intermediate: int, eps: float, scale: float) -> LayerSpec:
    """The LayerSpec of one decoder layer: input and post-attention norm weights [hidden] float32, and the
    (kind, tensor) of its q|k|v, o, gate|up and down linears, each checked to be the shape the layer's sizes give
    (the C code reads each as that shape). The tensors must stay alive while the spec is used."""
    hidden = norms[0].numel()
    if any(n.dtype != torch.float32 or not n.is_contiguous() or n.numel() != hidden for n in norms):
        raise ValueError(f"fused decode layer: norm weights {[tuple(n.shape) for n in norms]} are not two contiguous "
                         f"float32 rows of one width")
    if heads % kv_heads or head_dim % 2 or head_dim > MAX_HEAD_DIM:
        raise ValueError(f"fused decode layer: {heads} heads over {kv_heads} KV heads of {head_dim}: the kernels take "
                         f"whole groups of heads and an even head size up to {MAX_HEAD_DIM}")
    q_width, kv_width = heads * head_dim, kv_heads * head_dim
    sizes = {"q|k|v": (hidden, q_width + 2 * kv_width), "o": (q_width, hidden), "gate|up": (hidden, 2 * intermediate),
             "down": (intermediate, hidden)}
    for (name, (inputs, outputs)), (kind, tensor) in zip(sizes.items(), linears):
        want = _packed_shape(kind, inputs, outputs)
        dtype = torch.uint8 if kind == LINEAR_INT4 else torch.float32
        if kind not in (LINEAR_INT4, LINEAR_F32) or tuple(tensor.shape) != want or tensor.dtype != dtype \
                or not tensor.is_contiguous():
            raise ValueError(f"fused decode layer: the {name} weight is {tensor.dtype} {tuple(tensor.shape)}; "
                             f"{inputs} inputs and {outputs} outputs take a contiguous {dtype} {want}")
    return LayerSpec(norms[0].data_ptr(), norms[1].data_ptr(), *(LinearSpec(t.data_ptr(), k) for k, t in linears),
                     hidden, heads, kv_heads, head_dim, intermediate, eps, scale)
