"""The prefill way of the int4 layers: tiles of the packed weight dequantized per call, multiplied by torch's GEMMs.

For many rows a GEMM on the dequantized weight beats integer dot products: in float32 on CPUs with AVX2 only, in
bfloat16 where the CPU has bf16 dot products (AVX-512 BF16) or AMX tiles, which torch's bfloat16 GEMM (oneDNN)
runs. `dequantize` writes w = d q + m (cpllm/kernels/int4_avx2.c, from the stored float16 d and m; rounded once
to bfloat16 for that dtype) into a transient scratch of at most `SCRATCH_BYTES`: it lives for one call, so the
weight bytes per rank do not grow. `linear` picks the integer kernel ("vnni", int4_matmul.c, or "avx2",
int4_avx2.c) below `gemm_from_rows` rows and the GEMMs from there, as the start-up measurement chose
(int4_choice.py); it is a torch custom op under torch.compile. Below `records_below` rows the bfloat16 way runs a
kernel fed straight from the records instead (int4_records.py: AMX tiles, or AVX-512 BF16 dot products; each stored
group straight into an operand, no whole dequantized weight and no oneDNN reorder; int4_choice.py measures where
it pays). Results are float32 (a bfloat16 GEMM's output is rounded to bfloat16 first, its accumulation is float32),
or with `native` the GEMM's own bfloat16: the same values without the widening copy, for a consumer that reads bf16
(the MLP's silu(gate) * up; at 8K rows that copy of SmolLM2's gate|up output cost as much as a fifth of the GEMM).
Bad widths or output counts raise ValueError naming both.
"""

from __future__ import annotations

import torch

from cpllm.config.engine import QUANT_GROUP
from cpllm.kernels import int4_avx2, int4_matmul, int4_records
from cpllm.kernels.int4_matmul import BLOCK_ROWS
from cpllm.kernels.library import load_bound

SCRATCH_BYTES = 8 << 20
"""Largest dequantized weight tile a call holds at once (8 MiB: SmolLM2's widest layer in one float32 tile)."""
GEMM_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""The dtypes the GEMMs run in, by the names a choice and the custom op carry."""
INTEGER_KERNELS = {"vnni": int4_matmul.matmul, "avx2": int4_avx2.matmul}
"""The integer kernels `linear` calls below its threshold, by backend name."""


def dequantize(packed: torch.Tensor, out_features: int, first_block: int = 0, end_block: int | None = None,
               out: torch.Tensor | None = None, dtype: torch.dtype = torch.float32,
               row_by_row: bool = False) -> torch.Tensor:
    """[rows, in] in `dtype` (float32 or bfloat16): output rows [16 first_block, min(16 end_block, out_features))
    of the packed weight. bfloat16 runs 16 rows at once where the CPU has AVX-512 BF16, else (or `row_by_row`:
    the fallback, for tests) row by row on AVX2; the same bits."""
    blocks, groups, _ = packed.shape
    int4_avx2.check_shapes(groups * QUANT_GROUP, packed, out_features)
    end_block = blocks if end_block is None else end_block
    if not 0 <= first_block < end_block <= blocks:
        raise ValueError(f"blocks [{first_block}, {end_block}) of a weight of {blocks} blocks")
    if dtype not in GEMM_DTYPES.values():
        raise ValueError(f"dequantize to {dtype}: float32 or bfloat16 only")
    rows = min(end_block * BLOCK_ROWS, out_features) - first_block * BLOCK_ROWS
    if out is None:
        out = torch.empty(rows, groups * QUANT_GROUP, dtype=dtype)
    elif out.shape != (rows, groups * QUANT_GROUP) or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"dequantize: out {tuple(out.shape)} {out.dtype}; wants contiguous {dtype} "
                         f"{(rows, groups * QUANT_GROUP)}")
    load_bound("int4_avx2").cpllm_int4_avx2_dequantize(packed.data_ptr(), groups * QUANT_GROUP, out_features,
                                                       first_block, end_block, out.data_ptr(),
                                                       (2 if row_by_row else 1) if dtype == torch.bfloat16 else 0,
                                                       torch.get_num_threads())
    return out


def dequantized_matmul(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                       dtype: torch.dtype = torch.float32, native: bool = False,
                       records_below: int = 0) -> torch.Tensor:
    """y [M, out_features] = x [M, in] W^T through GEMMs in `dtype` on tiles of W dequantized in turn; float32, or
    in `dtype` with `native`. In bfloat16 below `records_below` rows: the record-fed kernel, where one runs."""
    with torch.profiler.record_function("cpllm::int4_dequantized_matmul"):  # a profile's name for the C calls
        return _dequantized_matmul(x, packed, out_features, dtype, native, records_below)


def _dequantized_matmul(x: torch.Tensor, packed: torch.Tensor, out_features: int, dtype: torch.dtype, native: bool,
                        records_below: int) -> torch.Tensor:
    xg = x if x.dtype == dtype and x.is_contiguous() else x.to(dtype).contiguous()
    if dtype == torch.bfloat16 and xg.shape[0] < records_below:
        y = int4_records.matmul(xg, packed, out_features, native)
        if y is not None:
            return y
    int4_avx2.check_shapes(xg.shape[1], packed, out_features)
    blocks, width = packed.shape[0], xg.shape[1]
    tile_blocks = max(1, SCRATCH_BYTES // (xg.element_size() * width * BLOCK_ROWS))
    y = torch.empty(xg.shape[0], out_features, dtype=dtype)
    scratch = torch.empty(min(blocks, tile_blocks) * BLOCK_ROWS * width, dtype=dtype)
    for first in range(0, blocks, tile_blocks):
        end = min(blocks, first + tile_blocks)
        rows = min(end * BLOCK_ROWS, out_features) - first * BLOCK_ROWS
        w = dequantize(packed, out_features, first, end, out=scratch[: rows * width].view(rows, -1), dtype=dtype)
        torch.mm(xg, w.t(), out=y[:, first * BLOCK_ROWS: first * BLOCK_ROWS + rows])
    return y if native else y.float()


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, integer: str, gemm_from_rows: int,
           gemm_dtype: str, native: bool = False, records_below: int = 0) -> torch.Tensor:
    """The `integer` kernel below `gemm_from_rows` rows, `dequantized_matmul` in `gemm_dtype` from there (the
    record-fed kernel below `records_below` rows); a custom op under torch.compile (float32 there: `native` asks, it
    does not oblige)."""
    if torch.compiler.is_compiling():
        return int4_linear_op(x, packed, out_features, integer, gemm_from_rows, gemm_dtype, records_below)
    return _linear(x, packed, out_features, integer, gemm_from_rows, gemm_dtype, native, records_below)


def gemm_dtype_for(rows: int, gemm_from_rows: int, gemm_dtype: str) -> torch.dtype | None:
    """The dtype `linear` rounds its input to for `rows` rows: the GEMMs' from `gemm_from_rows`, None below (the
    integer kernels quantize float32 input themselves)."""
    return GEMM_DTYPES[gemm_dtype] if rows >= gemm_from_rows else None


def _linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, integer: str, gemm_from_rows: int,
            gemm_dtype: str, native: bool = False, records_below: int = 0) -> torch.Tensor:
    if x.shape[0] >= gemm_from_rows:
        return dequantized_matmul(x, packed, out_features, GEMM_DTYPES[gemm_dtype], native, records_below)
    return INTEGER_KERNELS[integer](x, packed, out_features)


@torch.library.custom_op("cpllm::int4_linear", mutates_args=())
def int4_linear_op(x: torch.Tensor, packed: torch.Tensor, out_features: int, integer: str, gemm_from_rows: int,
                   gemm_dtype: str, records_below: int) -> torch.Tensor:
    """`linear` as one opaque op of a compiled graph."""
    return _linear(x, packed, out_features, integer, gemm_from_rows, gemm_dtype, records_below=records_below)


@int4_linear_op.register_fake
def _(x, packed, out_features, integer, gemm_from_rows, gemm_dtype, records_below):
    return x.new_empty(x.shape[0], out_features, dtype=torch.float32)
