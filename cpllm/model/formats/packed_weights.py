"""Weights prepacked for oneDNN's matmul, the CPU GEMM that runs the routed experts.

On this project's CPUs oneDNN's AVX-512 kernels, given a weight reordered once into their blocked layout, run
float32 prefill-sized products 10-15% faster than the MKL `torch.matmul` calls (and small batches of decode rows
up to 1.6x faster; docs/benchmarks.md, `benchmarks/moe_bench.py`). The packed tensor replaces the plain one, so
no weight is held twice; `unpack` gives the plain weight back, bit for bit. Where PyTorch lacks the ops, oneDNN is
off, the device is not the CPU or the dtype is one oneDNN does not pack here, `packs` is False and callers keep
their plain weights and `torch.matmul`.
"""

from __future__ import annotations

import functools

import torch

_DTYPES = (torch.float32, torch.bfloat16)
"""Dtypes packed (float16 needs AVX-NE-CONVERT or AVX512-FP16, which oneDNN checks for itself)."""


@functools.cache
def _ops_present() -> bool:
    """PyTorch was built with oneDNN and its linear ops answer on a tiny product."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    try:
        weight = torch.ops.mkldnn._reorder_linear_weight(torch.eye(4), None)
        return torch.equal(torch.ops.mkldnn._linear_pointwise(torch.eye(4), weight, None, "none", [], ""),
                           torch.eye(4))
    except RuntimeError:
        return False


def packs(dtype: torch.dtype, device: torch.device) -> bool:
    """Weights of this dtype on this device are packed."""
    return device.type == "cpu" and dtype in _DTYPES and _ops_present()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] (as stored by Hugging Face) -> the same weight in oneDNN's layout, for `matmul`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)


def matmul(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    # x [M, in] (any row stride) -> x @ weight.T [M, out]
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """The plain [out, in] weight `pack` was given."""
    return packed.to_dense()
