"""The routed experts one rank holds, run grouped by expert: only the tokens routed to an expert meet its weights.

Token-expert pairs are sorted by expert; each held expert gathers its run of tokens, multiplies them (one matmul
for gate|up, one for down), and adds the weighted results back to their tokens with index_add. The output is
this rank's partial sum; the MoE block (moe.py) sums the partials over the MoE group. The weights are one expert
method of their format (cpllm/model/formats/experts.py): float here, repacked on the CPU for oneDNN's matmul
(formats/packed_weights.py), which replaces the plain copy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cpllm.kernels.decode_rows import silu_mul
from cpllm.model.formats.experts import ExpertMethod, FloatExperts, MXFP4Weight
from cpllm.model.formats.loading import load_experts
from cpllm.model.loaders.loader import WeightSource
from cpllm.model.moe.placement import ExpertSlice


class ExpertTensors:
    """The ExpertReader of one expert per stored tensor (`{prefix}.experts.{e}.{gate|up|down}.weight`, HF layout)."""

    def __init__(self, source: WeightSource, prefix: str, names: tuple[str, str, str], held: ExpertSlice):
        self.source, self.prefix, self.names, self.held = source, prefix, names, held

    def fill_floats(self, expert: int, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        held, rows = self.held, self.held.rows
        name = f"{self.prefix}.experts.{held.first_expert + expert}"
        gate, up, down_name = self.names
        for j, proj in enumerate((gate, up)):  # HF [I, hidden]: our rows of it
            w = self.source.get(f"{name}.{proj}.weight", dim=0, start=held.row_start, end=held.row_end,
                                dtype=gate_up.dtype)
            gate_up[:, j * rows : (j + 1) * rows] = w.t()
        # HF down [hidden, I]: the same rows, as its columns
        w = self.source.get(f"{name}.{down_name}.weight", dim=1, start=held.row_start, end=held.row_end,
                            dtype=down.dtype)
        down.copy_(w.t())

    def mxfp4(self, expert: int) -> tuple[MXFP4Weight, MXFP4Weight]:
        raise ValueError(f"experts of {self.prefix} are stored one tensor per expert in a float type, not as MXFP4")


class LocalExperts(torch.nn.Module):
    """Experts [first, first + n) of a layer, each with intermediate rows [row_start, row_end)."""

    def __init__(self, prefix: str, names: tuple[str, str, str], hidden: int, held: ExpertSlice,
                 dtype: torch.dtype):
        super().__init__()
        self.prefix, self.names, self.held = prefix, names, held
        self.dtype = dtype
        self.method: ExpertMethod = FloatExperts(held.num_experts, hidden, held.rows, dtype)
        """The held experts' weights in their format (unloaded float stacks until `load`)."""

    def load(self, source: WeightSource) -> None:
        self.method = load_experts(ExpertTensors(source, self.prefix, self.names, self.held), self.method)

    def plain_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate|up [n, hidden, 2 rows], down [n, rows, hidden]) as loaded, whichever way they are held."""
        return self.method.plain_weights()

    @property
    def nbytes(self) -> int:
        return self.method.nbytes

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        # x [T, hidden], weights / ids [T, k] -> partial output [T, hidden]
        out = torch.zeros_like(x)
        k = ids.shape[1]
        local = ids.flatten() - self.held.first_expert  # [T*k] index among the held experts
        pairs = ((local >= 0) & (local < self.held.num_experts)).nonzero().squeeze(1)  # pairs held here
        if pairs.numel() == 0:
            return out
        order = torch.argsort(local[pairs], stable=True)  # group the pairs by expert
        pairs = pairs[order]
        experts = local[pairs]
        tokens = pairs // k
        counts = torch.bincount(experts, minlength=self.held.num_experts).tolist()
        scale = weights.flatten()[pairs].to(x.dtype).unsqueeze(1)  # [S, 1] routing weight of each pair
        rows, start = self.held.rows, 0
        matmul = self.method.matmul  # looked up once, not per expert
        # One expert's tokens at a time: buffers of one expert's size are reused by the allocator, where gathering
        # all S pairs at once allocates (and page-faults) S x hidden floats twice per layer.
        for e, count in enumerate(counts):
            if count:
                mine = tokens[start : start + count]
                h = matmul(e, x.index_select(0, mine), 0)  # [count, 2 * rows] = gate | up
                act = silu_mul(h, rows)  # one C pass on CPU float32 (as the dense MLP), else torch's two ops
                if act is None:  # silu(gate) * up written over gate: no new [count, rows] buffer
                    act = F.silu(h[:, :rows], inplace=True).mul_(h[:, rows:])
                y = matmul(e, act, 1)  # [count, hidden]
                out.index_add_(0, mine, y.mul_(scale[start : start + count]))
                start += count
        return out
