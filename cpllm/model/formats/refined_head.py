"""An LM head over Q8_0 rows run as stored, with the top of each row's logits recomputed in float32.

The int4 kernel (the Q8_0 rows as two 4-bit halves, cpllm/model/formats/groups.py) streams a quarter of the bytes
of a float32 head, but it is not float32 arithmetic: aten's kernel returns bfloat16 logits (steps of 1/8 at
magnitude 16-32, enough to tie the two best tokens and send greedy decoding down the other branch, plan.py),
and cpllm's VNNI kernel rounds the activations (about 2^-15 of each group's largest value), still enough to swap a
near tie. So the kernel only ranks: the REFINED best logits of each row are then recomputed exactly, in float32, from the same
stored rows (the values the float32 head holds, since that head is these rows dequantized), and written over
the kernel's. Greedy choices and the top of the distribution are then those of the float32 head unless its best
token falls outside the kernel's top REFINED, which needs an error of the kernel larger than the gap between
the first and the REFINED-th logit. The rest of the distribution keeps the kernel's rounding.
"""

from __future__ import annotations

import torch

from cpllm.model.formats.groups import Int8Groups
from cpllm.model.formats.group_kernels import Int4Linear, Int8Rows

REFINED = 16
"""Logits per row recomputed in float32."""


class RefinedInt8Head(torch.nn.Module):
    """logits = hidden W^T over int8 rows: kernel logits, the best REFINED of each row recomputed exactly."""

    def __init__(self, groups: Int8Groups, rows: Int8Rows | None = None):
        super().__init__()
        self.kernel = Int4Linear.from_int8(groups)
        self.rows = rows if rows is not None else Int8Rows(groups)
        """The stored rows, for the exact recomputation (shared with a tied Q8_0 embedding: no second copy)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden [M, H] -> logits [M, V] float32
        return self.refine(hidden, self.kernel(hidden).float())

    def refine(self, hidden: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """The kernel's logits [M, V] (float32) with each row's best REFINED recomputed exactly, in place."""
        top = logits.topk(min(REFINED, logits.shape[-1]), dim=-1).indices  # [M, K]
        rows = self.rows(top.reshape(-1), torch.float32).view(*top.shape, -1)  # [M, K, H]
        exact = torch.bmm(rows, hidden.float().unsqueeze(-1)).squeeze(-1)  # [M, K]
        return logits.scatter_(-1, top, exact)
