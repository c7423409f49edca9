"""A float weight prepacked in oneDNN's blocked layout (packed_weights.py), for linears no fused decode layer
reads: it replaces the plain weight, so nothing is held twice. A layout of the float format (float_format.py)."""

from __future__ import annotations

import torch

from cpllm.model.formats import packed_weights
from cpllm.model.formats.base import LinearMethod


class OneDNNWeight(LinearMethod):
    """y = x W^T (+ b) through oneDNN's matmul over a weight `packed_weights.pack` reordered once."""

    def __init__(self, packed: torch.Tensor):
        super().__init__()
        self.register_buffer("packed", packed)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # x [N, in] (any row stride) -> [N, out]
        y = packed_weights.matmul(x, self.packed)
        return y + bias if bias is not None else y

    def describe(self) -> str:
        return f"{str(self.packed.dtype).removeprefix('torch.')}, oneDNN prepacked"
