"""Kernels over 4-bit and 8-bit groups (a linear's int4 / int8 formats); int8 rows for a token embedding.

Three kernels run the 4-bit groups:
- where this CPU has AVX-512 VNNI, cpllm's own (cpllm/kernels/int4_matmul.c): activations quantized to int8 per
  group of 32 (llama.cpp's scheme for its 4-bit matmuls), integer dot products, float32 results; each group's
  step and offset kept in float16. Measured on SmolLM2's 30 layers: 1.5x aten's kernel at batch 1 and 3.7x at
  512 rows (benchmarks/int4_kernel.py).
- else, where it has AVX2 + FMA + F16C, cpllm's AVX2 kernel (cpllm/kernels/int4_avx2.c) on the same packed
  layout and arithmetic.
  With either, from a row count measured at start-up (prefill), tiles of the weight are dequantized in a transient
  scratch for torch's GEMMs, in bfloat16 where the CPU has bf16 dot products or AMX, else float32
  (cpllm/kernels/int4_gemm.py, int4_choice.py).
- elsewhere aten's (`_weight_int4pack_mm_for_cpu`), fast only with bfloat16 activations (float32 ones take a
  scalar path, ~10x slower; docs/platform.md, "PyTorch on the CPU"), so the input is cast to bfloat16 and the result back; it keeps
  each group's scale and zero in bfloat16 and returns bfloat16. Its packing wants output rows in multiples of
  16; other counts are padded with zero rows here and cut off the result.
The layer picks one at load and packs the weight for it only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cpllm.config.engine import QUANT_GROUP
from cpllm.kernels import int4_avx2, int4_choice, int4_gemm, int4_matmul
from cpllm.model.formats.groups import Int4Groups, Int8Groups

KERNEL_DTYPE = torch.bfloat16
ROW_MULTIPLE = 16
"""The CPU int4 packing refuses other output row counts."""


class Int4Linear(torch.nn.Module):
    """y = x W^T with W [out, in] in 4-bit groups: w = (q - 8) scale + zero per 32 inputs.

    With `repeat_input=2` the groups hold an int8 weight as two 4-bit halves side by side (Int8Groups), and the
    input is fed twice.
    """

    def __init__(self, groups: Int4Groups, repeat_input: int = 1, backend: str | None = None):
        """`backend`: "vnni", "avx2" or "aten"; None takes what int4_choice.choose picks for this CPU."""
        super().__init__()
        rows, cols = groups.shape
        if cols % (QUANT_GROUP * repeat_input) != 0:
            raise ValueError(f"a weight of {cols // repeat_input} input columns: the kernel needs a multiple of "
                             f"{QUANT_GROUP}")
        self.in_features, self.out_features, self.repeat_input = cols // repeat_input, rows, repeat_input
        if backend not in (None, "vnni", "avx2", "aten"):
            raise ValueError(f"backend={backend!r}; choose 'vnni', 'avx2', 'aten' or None")
        if backend == "vnni" and not int4_matmul.available():
            raise ValueError("backend='vnni': the VNNI int4 kernel is not built on this machine")
        if backend == "avx2" and not int4_avx2.available():
            raise ValueError("backend='avx2': the AVX2 int4 kernel is not built on this machine")
        choice = int4_choice.choose() if backend is None else int4_choice.choose_backend(backend)
        self.backend = choice.backend
        """Which integer kernel runs this layer (see the module)."""
        self.gemm_from_rows = choice.gemm_from_rows
        """vnni / avx2: rows from which a call runs GEMMs on the dequantized weight (measured at start-up)."""
        self.gemm_dtype = choice.gemm_dtype
        """vnni / avx2: those GEMMs' dtype, "bfloat16" or "float32" (measured at start-up)."""
        self.records_below = choice.records_below
        """vnni / avx2 with bfloat16 GEMMs: rows below which they run on the kernels fed straight from the int4
        records, AMX tiles or AVX-512 BF16 dot products (cpllm/kernels/int4_records.py; 0: never; measured at
        start-up)."""
        self.weight_format = "int8" if repeat_input == 2 else "int4"
        """What the groups hold, for the start-up log's weight bytes (cpllm/model/formats/report.py)."""
        if self.backend in ("vnni", "avx2"):  # one packed layout for both kernels
            self.register_buffer("packed", int4_matmul.pack(groups.codes, groups.d, groups.m))
            return
        pad = -rows % ROW_MULTIPLE
        codes, d, m = (F.pad(t, (0, 0, 0, pad)) for t in (groups.codes, groups.d, groups.m))  # zero rows give 0
        # the CPU packing wants the codes as int32 [out, in]; its inner-k-tiles argument is unused on CPU
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 2)
        # w = d q + m = (q - 8) d + (m + 8 d): scale d, zero m + 8 d, laid out [in / 32, out, 2]
        scales_and_zeros = torch.stack([d, m + 8 * d], dim=-1).transpose(0, 1)
        self.register_buffer("packed", packed)  # uint8 [padded out, in / 2]
        self.register_buffer("scales_and_zeros", scales_and_zeros.to(KERNEL_DTYPE).contiguous())

    def input_dtype(self, rows: int) -> torch.dtype | None:
        """The dtype a call of `rows` rows rounds its input to before any arithmetic, or None where it reads it as
        given: a caller may hand it that dtype directly and get the same result."""
        if self.backend in ("vnni", "avx2"):
            return int4_gemm.gemm_dtype_for(rows, self.gemm_from_rows, self.gemm_dtype)
        return KERNEL_DTYPE

    @classmethod
    def from_int8(cls, groups: Int8Groups) -> "Int4Linear":
        """An 8-bit grouped weight, exactly (up to the bfloat16 scale), as two 4-bit halves."""
        return cls(groups.as_int4_halves(), repeat_input=2)

    def forward(self, x: torch.Tensor, native: bool = False) -> torch.Tensor:
        # x [N, in] -> [N, out] in x.dtype; with `native`, in the dtype the product was rounded to (bfloat16 where
        # the GEMMs run in it: see input_dtype)
        if self.backend in ("vnni", "avx2"):
            xk = x.repeat(1, self.repeat_input) if self.repeat_input > 1 else x
            y = int4_gemm.linear(xk, self.packed, self.out_features, self.backend, self.gemm_from_rows,
                                 self.gemm_dtype, native, self.records_below)
            return y if native else y.to(x.dtype)
        xk = x.to(KERNEL_DTYPE)
        xk = xk.repeat(1, self.repeat_input) if self.repeat_input > 1 else xk.contiguous()
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xk, self.packed, QUANT_GROUP, self.scales_and_zeros)
        if y.shape[1] != self.out_features:  # padded rows
            y = y[:, : self.out_features]
        return y.to(x.dtype)


class Int8Rows(torch.nn.Module):
    """Rows of an int8 grouped weight (a Q8_0 token embedding), looked up exactly: d q in float32."""

    weight_format = "int8"

    def __init__(self, groups: Int8Groups):
        super().__init__()
        self.register_buffer("codes", groups.codes.contiguous())  # int8 [rows, cols]
        self.register_buffer("d", groups.d.float().contiguous())  # [rows, cols / 32]

    def forward(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # ids [N] -> [N, cols]
        codes = F.embedding(ids, self.codes).float()  # [N, cols]
        d = F.embedding(ids, self.d).repeat_interleave(QUANT_GROUP, dim=1)
        return (codes * d).to(dtype)
