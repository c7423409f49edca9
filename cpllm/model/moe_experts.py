"""The routed experts one rank holds, run grouped by expert: only the tokens routed to an expert meet its weights.

Token-expert pairs are sorted by expert; each held expert gathers its run of tokens, multiplies them (one matmul
for gate|up, one for down), and adds the weighted results back to their tokens with index_add. The output is
this rank's partial sum; the MoE block (moe.py) sums the partials over the MoE group. On the CPU the loaded
weights are repacked for oneDNN's matmul (packed_weights.py), which replaces the plain copy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cpllm.kernels.decode_rows import silu_mul
from cpllm.model import packed_weights
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
        self.dtype = dtype
        self.packed: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        """Once loaded, where oneDNN packs: per expert (gate|up [2 * rows, hidden], down [hidden, rows]) in its
        layout; the plain parameters are then dropped (None)."""

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
        if packed_weights.packs(dtype, self.gate_up.device):
            self.packed = [(packed_weights.pack(self.gate_up[i].t()), packed_weights.pack(self.down[i].t()))
                           for i in range(held.num_experts)]
            self.gate_up = self.down = None

    def plain_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate|up [n, hidden, 2 * rows], down [n, rows, hidden]) as loaded, whichever way they are held."""
        if self.packed is None:
            return self.gate_up, self.down
        return (torch.stack([packed_weights.unpack(g).t() for g, _ in self.packed]),
                torch.stack([packed_weights.unpack(d).t() for _, d in self.packed]))

    @property
    def nbytes(self) -> int:
        held = [w for pair in self.packed for w in pair] if self.packed is not None else [self.gate_up, self.down]
        return sum(w.numel() * w.element_size() for w in held)

    def _expert(self, e: int, x: torch.Tensor, which: int) -> torch.Tensor:
        # x [count, in] -> expert e's gate|up (which = 0) or down (1) product
        if self.packed is not None:
            return packed_weights.matmul(x, self.packed[e][which])
        return x @ (self.gate_up if which == 0 else self.down)[e]

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
                h = self._expert(e, x.index_select(0, mine), 0)  # [count, 2 * rows] = gate | up
                act = silu_mul(h, rows)  # one C pass on CPU float32 (as the dense MLP), else torch's two ops
                if act is None:  # silu(gate) * up written over gate: no new [count, rows] buffer
                    act = F.silu(h[:, :rows], inplace=True).mul_(h[:, rows:])
                y = self._expert(e, act, 1)  # [count, hidden]
                out.index_add_(0, mine, y.mul_(scale[start : start + count]))
                start += count
        return out
