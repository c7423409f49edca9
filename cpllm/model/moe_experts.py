"""The routed experts one rank holds, run grouped by expert: only the tokens routed to an expert meet its weights.

Token-expert pairs are sorted by expert; each held expert gathers its run of tokens, multiplies them (one matmul
for gate|up, one for down), and adds the weighted results back to their tokens with index_add. The output is
this rank's partial sum; the MoE block (moe.py) sums the partials over the MoE group.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cpllm.model.loader import WeightSource
from cpllm.model.moe_placement import ExpertSlice


class LocalExperts(torch.nn.Module):
    """Experts [first, first + n) of a layer, each with intermediate rows [row_start, row_end)."""

    def __init__(self, prefix: str, names: tuple[str, str, str], hidden: int, held: ExpertSlice,
                 dtype: torch.dtype):
        super().__init__()
        self.prefix, self.names, self.held = prefix, names, held
        n, rows = held.num_experts, held.rows
        # Stored transposed ([in, out]) like the dense layers: x @ W
        self.gate_up = torch.nn.Parameter(torch.empty(n, hidden, 2 * rows, dtype=dtype), requires_grad=False)
        self.down = torch.nn.Parameter(torch.empty(n, rows, hidden, dtype=dtype), requires_grad=False)

    def load(self, source: WeightSource) -> None:
        gate, up, down = self.names
        held, rows, dtype = self.held, self.held.rows, self.gate_up.dtype
        for i in range(held.num_experts):
            name = f"{self.prefix}.experts.{held.first_expert + i}"
            for j, proj in enumerate((gate, up)):  # HF [I, hidden]: our rows of it
                w = source.get(f"{name}.{proj}.weight", dim=0, start=held.row_start, end=held.row_end, dtype=dtype)
                self.gate_up[i, :, j * rows : (j + 1) * rows] = w.t()
            # HF down [hidden, I]: the same rows, as its columns
            w = source.get(f"{name}.{down}.weight", dim=1, start=held.row_start, end=held.row_end, dtype=dtype)
            self.down[i] = w.t()

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in (self.gate_up, self.down))

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
        # One expert's tokens at a time: buffers of one expert's size are reused by the allocator, where gathering
        # all S pairs at once allocates (and page-faults) S x hidden floats twice per layer.
        for e, count in enumerate(counts):
            if count:
                mine = tokens[start : start + count]
                h = x.index_select(0, mine) @ self.gate_up[e]  # [count, 2 * rows] = gate | up
                # silu(gate) * up written over gate: no new [count, rows] buffers (same values, same rounding)
                act = F.silu(h[:, :rows], inplace=True).mul_(h[:, rows:])
                y = act @ self.down[e]  # [count, hidden]
                out.index_add_(0, mine, y.mul_(scale[start : start + count]))
                start += count
        return out
