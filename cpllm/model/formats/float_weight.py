"""A plain float weight, stored transposed [in, out]: the format of every linear under quantization=none."""

from __future__ import annotations

import torch

from cpllm.model.formats import packed_weights
from cpllm.model.formats.base import FusedWeight, LinearMethod, Ranges
from cpllm.model.formats.onednn import OneDNNWeight
from cpllm.model.loaders.loader import WeightSource


class FloatWeight(LinearMethod):
    """y = x W (+ b) with W [in, out]: x @ W streams the weight ~25% faster than F.linear for one-row decode."""

    def __init__(self, weight_in_out: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(weight_in_out, requires_grad=False)

    @classmethod
    def empty(cls, in_features: int, out_features: int, dtype: torch.dtype) -> "FloatWeight":
        """Unloaded, on the default device (the linear's device until `fill` or a quantized load)."""
        return cls(torch.empty(in_features, out_features, dtype=dtype))

    def fill(self, source: WeightSource, ranges: Ranges, dim: int) -> None:
        """Load in place: dim 0, output rows of stored tensors packed in order (q|k|v); dim 1, one tensor's input
        columns (a row-parallel shard)."""
        if dim == 1:
            (name, start, end), = ranges
            self.weight.copy_(source.get(name, dim=1, start=start, end=end, dtype=self.weight.dtype).t())
            return
        offset = 0
        for name, start, end in ranges:
            self.weight[:, offset : offset + end - start] = source.get(
                name, dim=0, start=start, end=end, dtype=self.weight.dtype).t()
            offset += end - start

    @property
    def on_cpu(self) -> bool:
        return self.weight.device.type == "cpu"

    @property
    def in_features(self) -> int:
        return self.weight.shape[0]

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # x [N, in] -> [N, out]
        return torch.addmm(bias, x, self.weight) if bias is not None else x @ self.weight

    def describe(self) -> str:
        return f"{str(self.weight.dtype).removeprefix('torch.')} {list(self.weight.shape)}"

    def fused_spec(self) -> FusedWeight | None:
        w = self.weight
        return FusedWeight("float32", w) if w.dtype == torch.float32 and w.is_contiguous() else None

    def columns(self, start: int, end: int) -> torch.Tensor:
        return self.weight[:, start:end]

    def prepacked(self) -> LinearMethod:
        if not packed_weights.packs(self.weight.dtype, self.weight.device):
            return self
        return OneDNNWeight(packed_weights.pack(self.weight.t()))
