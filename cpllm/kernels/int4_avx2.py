"""4-bit grouped weights on CPUs with AVX2 + FMA + F16C and no AVX-512 VNNI (cpllm/kernels/int4_avx2.c).

The weight is the VNNI kernel's layout (`int4_matmul.pack`), so it holds the same int4 bytes. Two ways to multiply:
- `matmul`: activations quantized to int8 per group (the VNNI kernel's scheme and arithmetic) and integer dot
  products; the weights stream once per call, so batch-1 and small-batch decode run near the weight-stream rate.
- `dequantized_matmul`: for many rows (prefill), tiles of the weight dequantized to float32 (d q + m, from the
  stored float16 d and m) into a transient scratch of at most `SCRATCH_BYTES`, each multiplied by torch's float32
  GEMM (oneDNN / MKL). The scratch lives for one call only: weight bytes per rank do not grow.
`linear` picks one by the row count against the threshold that the start-up measurement chose (int4_choice.py),
and is a torch custom op under torch.compile. Bad widths or output counts raise ValueError naming both.
"""

from __future__ import annotations

import torch

from cpllm.config.engine import QUANT_GROUP
from cpllm.kernels.int4_matmul import BLOCK_ROWS
from cpllm.kernels.library import load, load_bound

SCRATCH_BYTES = 8 << 20
"""Largest float32 weight tile `dequantized_matmul` holds at once (8 MiB: SmolLM2's widest layer in one tile)."""


def available() -> bool:
    """The kernels are on, this one is built and it was compiled with AVX2, FMA and F16C (builds it on the first
    call)."""
    lib = load("int4_avx2")
    return lib is not None and lib.cpllm_int4_avx2_available() == 1


def _check(width: int, packed: torch.Tensor, out_features: int) -> None:
    blocks, groups, _ = packed.shape
    if width != groups * QUANT_GROUP or not blocks * BLOCK_ROWS - BLOCK_ROWS < out_features <= blocks * BLOCK_ROWS:
        raise ValueError(f"int4 avx2 matmul: activations of width {width} and {out_features} outputs against a "
                         f"weight packed for {groups * QUANT_GROUP} inputs and {blocks * BLOCK_ROWS - BLOCK_ROWS + 1} "
                         f"to {blocks * BLOCK_ROWS} outputs")


def _float_rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()


def matmul(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """y [M, out_features] float32 = x [M, in] W^T by integer dot products (W packed by `int4_matmul.pack`)."""
    x32 = _float_rows(x)
    _check(x32.shape[1], packed, out_features)
    y = torch.empty(x32.shape[0], out_features, dtype=torch.float32)
    if x32.shape[0] == 0:
        return y
    status = load_bound("int4_avx2").cpllm_int4_avx2_matmul(x32.data_ptr(), x32.shape[0], x32.shape[1],
                                                           packed.data_ptr(), out_features, y.data_ptr(),
                                                           torch.get_num_threads())
    if status != 0:
        raise MemoryError(f"int4 avx2 kernel could not allocate its scratch for {x32.shape[0]} rows")
    return y


def dequantize(packed: torch.Tensor, out_features: int, first_block: int = 0, end_block: int | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [rows, in]: output rows [16 first_block, min(16 end_block, out_features)) of the packed weight."""
    blocks, groups, _ = packed.shape
    _check(groups * QUANT_GROUP, packed, out_features)
    end_block = blocks if end_block is None else end_block
    if not 0 <= first_block < end_block <= blocks:
        raise ValueError(f"blocks [{first_block}, {end_block}) of a weight of {blocks} blocks")
    rows = min(end_block * BLOCK_ROWS, out_features) - first_block * BLOCK_ROWS
    if out is None:
        out = torch.empty(rows, groups * QUANT_GROUP, dtype=torch.float32)
    elif out.shape != (rows, groups * QUANT_GROUP) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"dequantize: out {tuple(out.shape)} {out.dtype}; wants contiguous float32 "
                         f"{(rows, groups * QUANT_GROUP)}")
    load_bound("int4_avx2").cpllm_int4_avx2_dequantize(packed.data_ptr(), groups * QUANT_GROUP, out_features,
                                                       first_block, end_block, out.data_ptr(),
                                                       torch.get_num_threads())
    return out


def dequantized_matmul(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """y [M, out_features] float32 = x [M, in] W^T through float32 GEMMs on tiles of W dequantized in turn."""
    x32 = _float_rows(x)
    _check(x32.shape[1], packed, out_features)
    blocks = packed.shape[0]
    tile_blocks = max(1, SCRATCH_BYTES // (4 * x32.shape[1] * BLOCK_ROWS))
    y = torch.empty(x32.shape[0], out_features, dtype=torch.float32)
    scratch = torch.empty(min(blocks, tile_blocks) * BLOCK_ROWS * x32.shape[1], dtype=torch.float32)
    for first in range(0, blocks, tile_blocks):
        end = min(blocks, first + tile_blocks)
        rows = min(end * BLOCK_ROWS, out_features) - first * BLOCK_ROWS
        w = dequantize(packed, out_features, first, end, out=scratch[: rows * x32.shape[1]].view(rows, -1))
        torch.mm(x32, w.t(), out=y[:, first * BLOCK_ROWS: first * BLOCK_ROWS + rows])
    return y


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, gemm_from_rows: int) -> torch.Tensor:
    """`matmul` below `gemm_from_rows` rows, `dequantized_matmul` from there; a custom op under torch.compile."""
    if torch.compiler.is_compiling():
        return int4_avx2_linear_op(x, packed, out_features, gemm_from_rows)
    return _linear(x, packed, out_features, gemm_from_rows)


def _linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, gemm_from_rows: int) -> torch.Tensor:
    if x.shape[0] >= gemm_from_rows:
        return dequantized_matmul(x, packed, out_features)
    return matmul(x, packed, out_features)


@torch.library.custom_op("cpllm::int4_avx2_linear", mutates_args=())
def int4_avx2_linear_op(x: torch.Tensor, packed: torch.Tensor, out_features: int, gemm_from_rows: int) -> torch.Tensor:
    """`linear` as one opaque op of a compiled graph."""
    return _linear(x, packed, out_features, gemm_from_rows)


@int4_avx2_linear_op.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, out_features: int, gemm_from_rows: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features, dtype=torch.float32)
