"""RMSNorm of float32 rows in one C pass (cpllm/kernels/rms_norm.c), for eager CPU steps.

A decode step normalizes two rows per layer; torch's CPU rms_norm runs six ops for each. Compiled graphs keep
torch's op (inductor fuses it), and where the kernel is not built `rms_norm` returns None and the caller runs
torch's.
"""

from __future__ import annotations

import ctypes

import torch

from cpllm.kernels.build import load_typed

_lib: ctypes.CDLL | None = None
"""The loaded library, kept once found: a lookup per call would cost a fifth of the call."""


def _library() -> ctypes.CDLL | None:
    global _lib
    if _lib is None:
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        _lib = load_typed("rms_norm",
                          {"cpllm_rms_norm": ([p, p, ctypes.c_float, i64, i64, i64, i64, p, ctypes.c_int], None)})
    return _lib


def _row_layout(x: torch.Tensor) -> tuple[int, int] | None:
    """(groups, stride) the kernel reads x's rows with: contiguous x, or [N, G, D] with each [G, D] contiguous
    (per-head q or k inside the fused q|k|v rows); None otherwise."""
    width = x.shape[-1]
    if x.is_contiguous():
        return 1, width
    if x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == width:
        return x.shape[1], x.stride(0)
    return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """weight * x / sqrt(mean(x^2, -1) + eps) for float32 CPU tensors (contiguous out), or None where the kernel
    does not apply."""
    if (x.dtype != torch.float32 or weight.dtype != torch.float32 or x.device.type != "cpu"
            or torch.compiler.is_compiling()):
        return None
    layout = _row_layout(x)
    lib = _library() if layout is not None else None
    if lib is None:
        return None
    out = torch.empty(x.shape, dtype=x.dtype)
    width = x.shape[-1]
    lib.cpllm_rms_norm(x.data_ptr(), weight.data_ptr(), eps, x.numel() // width if width else 0, width, *layout,
                       out.data_ptr(), torch.get_num_threads())
    return out
