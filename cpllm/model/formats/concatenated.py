"""Packed parts (q|k|v, gate|up) held in more than one format, e.g. llama.cpp's Q4_K_M files: Q4_K q and k beside a
Q6_K v. Each run of parts sharing a format is one method; their outputs are joined along the output columns, so no
part is dequantized for its neighbours' sake."""

from __future__ import annotations

import torch

from cpllm.model.formats.base import LinearMethod


class ConcatenatedWeights(LinearMethod):
    """y = [x W_1^T | x W_2^T | ...] (+ b), one method per run of output rows."""

    def __init__(self, runs: list[LinearMethod]):
        super().__init__()
        self.runs = torch.nn.ModuleList(runs)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # x [N, in] -> [N, sum of the runs' out]
        y = torch.cat([run.matmul(x) for run in self.runs], dim=-1)
        return y + bias if bias is not None else y

    def describe(self) -> str:
        return " | ".join(run.describe() for run in self.runs)
