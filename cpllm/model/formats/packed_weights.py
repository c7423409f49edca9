"""Weights prepacked for oneDNN's matmul, the CPU GEMM that runs the routed experts.

On this project's CPUs oneDNN's AVX-512 kernels, given a weight reordered once into their blocked layout, run
float32 prefill-sized products 10-15% faster than the MKL `torch.matmul` calls (and small batches of decode rows
up to 1.6x faster; docs/benchmarks.md, `benchmarks/moe_bench.py`). The packed tensor replaces the plain one, so
no weight is held twice; `unpack` gives the plain weight back, bit for bit. Where PyTorch lacks the ops, oneDNN is
off, the device is not the CPU, the dtype is one oneDNN does not pack here or this CPU lacks what oneDNN needs
for it (bf16 on an AVX2-only CPU), `packs` is False and callers keep their plain weights and `torch.matmul`.
"""

from __future__ import annotations

import functools
import logging

import torch

logger = logging.getLogger(__name__)

_DTYPES = (torch.float32, torch.bfloat16)
"""Dtypes packed (float16 needs AVX-NE-CONVERT or AVX512-FP16, which oneDNN checks for itself)."""


@functools.cache
def _cpu_packs(dtype: torch.dtype) -> bool:
    """PyTorch was built with oneDNN and this CPU packs and multiplies `dtype` on a tiny product. A trial, not a
    flag check: oneDNN's bf16 reorder needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT and raises on AVX2-only CPUs
    (docs/platform.md, "The CPUs"), and oneDNN knows its own requirements best. Asked and logged once per dtype."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        logger.info("oneDNN prepacking: off (PyTorch has no oneDNN linear ops); plain weights and torch.matmul")
        return False
    eye = torch.eye(4, dtype=dtype)
    try:
        weight = torch.ops.mkldnn._reorder_linear_weight(eye, None)
        works = torch.equal(torch.ops.mkldnn._linear_pointwise(eye, weight, None, "none", [], ""), eye)
        reason = "" if works else " (its product is wrong)"
    except RuntimeError as error:
        works, reason = False, f" ({str(error).splitlines()[0]})"
    dtype_name = str(dtype).removeprefix("torch.")
    logger.info("oneDNN prepacking of %s weights: %s%s", dtype_name,
                "on" if works else "off, plain weights and torch.matmul", reason)
    return works


def packs(dtype: torch.dtype, device: torch.device) -> bool:
    """Weights of this dtype on this device are packed (else callers keep the plain weight, same numbers as
    unpacked)."""
    return device.type == "cpu" and dtype in _DTYPES and _cpu_packs(dtype)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] (as stored by Hugging Face) -> the same weight in oneDNN's layout, for `matmul`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)


def matmul(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    # x [M, in] (any row stride) -> x @ weight.T [M, out]
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """The plain [out, in] weight `pack` was given."""
    return packed.to_dense()
