"""RMSNorm of float32 rows in one C pass (cpllm/kernels/rms_norm.c), for eager CPU steps.

A decode step normalizes two rows per layer; torch's CPU rms_norm runs six ops for each. Compiled graphs keep
torch's op (inductor fuses it), and where the kernel is off or not built `rms_norm` returns None and the caller runs
torch's. A weight whose width is not the rows' raises ValueError (the kernel would read past it).
"""

from __future__ import annotations

import torch

from cpllm.kernels.library import load


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
            or not weight.is_contiguous() or torch.compiler.is_compiling()):
        return None
    layout = _row_layout(x)
    lib = load("rms_norm") if layout is not None else None
    if lib is None:
        return None
    width = x.shape[-1]
    if weight.numel() != width:  # what the kernel reads (numel costs a third of comparing shapes)
        raise ValueError(f"RMSNorm kernel: weight {tuple(weight.shape)} does not match the rows' width {width}")
    out = torch.empty(x.shape, dtype=x.dtype)
    lib.cpllm_rms_norm(x.data_ptr(), weight.data_ptr(), eps, x.numel() // width if width else 0, width, *layout,
                       out.data_ptr(), torch.get_num_threads())
    return out


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(sum, norm): sum = x + delta (x float32, delta float32 or a bf16 GEMM's bfloat16 output; None: sum is x)
    and `rms_norm` of it in `out_dtype` (float32, or bfloat16 rounded as torch rounds), in one pass over
    contiguous [N, width] rows; None where the kernel does not apply. The bits of x + delta, `rms_norm` and a cast."""
    if (x.dtype != torch.float32 or weight.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2
            or not x.is_contiguous() or not weight.is_contiguous() or torch.compiler.is_compiling()
            or out_dtype not in (torch.float32, torch.bfloat16)):
        return None
    if delta is not None and (delta.shape != x.shape or delta.dtype not in (torch.float32, torch.bfloat16)
                              or not delta.is_contiguous()):
        return None
    lib = load("rms_norm")
    if lib is None:
        return None
    rows, width = x.shape
    if weight.numel() != width:
        raise ValueError(f"RMSNorm kernel: weight {tuple(weight.shape)} does not match the rows' width {width}")
    total = torch.empty_like(x) if delta is not None else x
    out = torch.empty(rows, width, dtype=out_dtype)
    lib.cpllm_add_rms_norm(x.data_ptr(), None if delta is None else delta.data_ptr(),
                           int(delta is not None and delta.dtype == torch.bfloat16), weight.data_ptr(), eps, rows,
                           width, total.data_ptr(), out.data_ptr(), int(out_dtype == torch.bfloat16),
                           torch.get_num_threads())
    return total, out


def add_residual(x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """x + delta for a float32 residual x and a delta in the model's dtype or a bf16 GEMM's bfloat16 (added as it
    is, in one C pass on the CPU where the kernel runs: the bits of torch's add after widening)."""
    if (delta.dtype == torch.bfloat16 and x.dtype == torch.float32 and x.device.type == "cpu"
            and delta.shape == x.shape and x.is_contiguous() and delta.is_contiguous()
            and not torch.compiler.is_compiling()):
        lib = load("rms_norm")
        if lib is not None:
            out = torch.empty_like(x)
            lib.cpllm_add_bf16_rows(x.data_ptr(), delta.data_ptr(), x.numel(), out.data_ptr(), torch.get_num_threads())
            return out
    return x + delta.to(x.dtype)
