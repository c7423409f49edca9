"""The top-k of the indexer's scores in one C call (cpllm/kernels/index_topk.c), by the tie rule of
cpllm/layers/sparse_mla/topk.py, bit for bit: a radix select on one 64-bit key per (score, position) instead of
the torch form's two full sorts of every row.

`index_top_k` returns None where the kernel does not apply (kernels off or not built, another device, a dtype
other than float32 scores with int64 or int32 positions, a position the key cannot hold, under torch.compile)
and the caller runs the torch form (`top_k`'s body). Shapes are checked by the caller.
"""

from __future__ import annotations

import torch

from cpllm.kernels.checks import NO_MEMORY, UNSUPPORTED_SHAPE, check_shape
from cpllm.kernels.library import load

POSITION_DTYPES = {torch.int64: 0, torch.int32: 1}
"""The positions' dtypes the kernel reads -> its code."""


def index_top_k(scores: torch.Tensor, positions: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """scores [L, T] float32, positions [T] or [L, T] (int64 or int32) -> (scores [L, k'], positions [L, k']) of
    min(k, T) per row, best first, positions in their own dtype; or None (see the module)."""
    if not (scores.device.type == positions.device.type == "cpu" and scores.dtype == torch.float32
            and positions.dtype in POSITION_DTYPES and scores.shape[1] > 0 and not torch.compiler.is_compiling()):
        return None
    lib = load("index_topk")
    if lib is None:
        return None
    rows, width = scores.shape
    if scores.stride(1) != 1:
        scores = scores.contiguous()
    if positions.dim() == 2 and positions.stride(0) == 0:
        positions = positions[0]  # an expanded [T]: read once
    positions = positions.contiguous()
    pos_stride = 0 if positions.dim() == 1 else width
    kept = min(k, width)
    out_scores = torch.empty(rows, kept, dtype=torch.float32)
    out_pos = torch.empty(rows, kept, dtype=positions.dtype)
    status = lib.cpllm_index_topk(scores.data_ptr(), scores.stride(0), positions.data_ptr(),
                                  POSITION_DTYPES[positions.dtype], pos_stride, rows, width, k,
                                  torch.get_num_threads(), out_scores.data_ptr(), out_pos.data_ptr())
    if status == UNSUPPORTED_SHAPE:
        return None  # a position outside the key's 32 bits: the torch form holds it
    if status == NO_MEMORY:
        raise MemoryError(f"index top-k kernel: no memory for rows of {width} keys")
    check_shape("index top-k", status == 0, f"status {status} for {rows} rows of {width} keys, k={k}")
    return out_scores, out_pos
