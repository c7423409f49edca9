"""Weights in 4-bit or 8-bit groups, run in the int4 kernel (group_kernels.py): GGUF blocks as stored, or a float
weight quantized at load. The linear method of the int8 and int4 formats (int8_format.py, int4_format.py)."""

from __future__ import annotations

import torch

from cpllm.model.formats.base import FusedWeight, LinearMethod
from cpllm.model.formats.group_kernels import Int4Linear


class GroupedWeight(LinearMethod):
    """y = x W^T (+ b), W in one int4 kernel: 4-bit groups ("int4"), or 8-bit groups as two 4-bit halves ("int8")."""

    def __init__(self, kernel: Int4Linear):
        super().__init__()
        self.kernel = kernel
        self.weight_format = kernel.weight_format

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # x [N, in] -> [N, out] in x.dtype
        y = self.kernel(x)
        return y + bias if bias is not None else y

    def matmul_native(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.kernel(x, native=True) if bias is None else self.matmul(x, bias)

    def input_dtype(self, rows: int) -> torch.dtype | None:
        return self.kernel.input_dtype(rows)

    def describe(self) -> str:
        halves = ", two 4-bit halves" if self.kernel.repeat_input == 2 else ""
        return (f"{self.weight_format} groups of 32{halves}, {self.kernel.backend} kernel "
                f"[{self.kernel.in_features} -> {self.kernel.out_features}]")

    def fused_spec(self) -> FusedWeight | None:
        # the C layer takes the VNNI kernel's 4-bit layout over the input as it comes (not fed twice)
        if self.kernel.backend != "vnni" or self.kernel.repeat_input != 1:
            return None
        return FusedWeight("int4", self.kernel.packed)
