"""4-bit grouped weights on CPUs with AVX2 + FMA + F16C and no AVX-512 VNNI (cpllm/kernels/int4_avx2.c).

The weight is the VNNI kernel's layout (`int4_matmul.pack`), so it holds the same int4 bytes. `matmul`: activations
quantized to int8 per group (the VNNI kernel's scheme and arithmetic) and integer dot products; the weights stream
once per call, so batch-1 and small-batch decode run near the weight-stream rate. For many rows (prefill) the
weight is dequantized in tiles for torch's GEMMs instead (int4_gemm.py, which also calls this library's
`cpllm_int4_avx2_dequantize`). Bad widths or output counts raise ValueError naming both.
"""

from __future__ import annotations

import torch

from cpllm.config.engine import QUANT_GROUP
from cpllm.kernels.int4_matmul import BLOCK_ROWS
from cpllm.kernels.library import load, load_bound


def available() -> bool:
    """The kernels are on, this one is built and it was compiled with AVX2, FMA and F16C (builds it on the first
    call)."""
    lib = load("int4_avx2")
    return lib is not None and lib.cpllm_int4_avx2_available() == 1


def check_shapes(width: int, packed: torch.Tensor, out_features: int) -> None:
    blocks, groups, _ = packed.shape
    if width != groups * QUANT_GROUP or not blocks * BLOCK_ROWS - BLOCK_ROWS < out_features <= blocks * BLOCK_ROWS:
        raise ValueError(f"int4 matmul: activations of width {width} and {out_features} outputs against a "
                         f"weight packed for {groups * QUANT_GROUP} inputs and {blocks * BLOCK_ROWS - BLOCK_ROWS + 1} "
                         f"to {blocks * BLOCK_ROWS} outputs")


def _float_rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()


def matmul(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """y [M, out_features] float32 = x [M, in] W^T by integer dot products (W packed by `int4_matmul.pack`)."""
    x32 = _float_rows(x)
    check_shapes(x32.shape[1], packed, out_features)
    y = torch.empty(x32.shape[0], out_features, dtype=torch.float32)
    if x32.shape[0] == 0:
        return y
    status = load_bound("int4_avx2").cpllm_int4_avx2_matmul(x32.data_ptr(), x32.shape[0], x32.shape[1],
                                                           packed.data_ptr(), out_features, y.data_ptr(),
                                                           torch.get_num_threads())
    if status != 0:
        raise MemoryError(f"int4 avx2 kernel could not allocate its scratch for {x32.shape[0]} rows")
    return y
