"""Formats of the LM head's weight (the plan: cpllm/model/formats/plan.py, `lm_head_plan`). The head itself
(cpllm/model/layers.py) splits the vocabulary over TP and, where asked, this TP shard's columns over PCP; these
compute a shard's logits, or one PCP rank's columns of it, and the int8 one refines the joined logits."""

from __future__ import annotations

import torch

from cpllm.model.loaders.loader import WeightSource
from cpllm.model.formats.group_kernels import Int4Linear
from cpllm.model.formats.refined_head import REFINED, RefinedInt8Head


class HeadMethod(torch.nn.Module):
    """One format of a vocabulary shard's head weight."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [M, hidden] -> the shard's logits [M, shard rows], float32."""
        raise NotImplementedError

    def split(self, source: WeightSource, name: str, offset: int, first: int, last: int) -> None:
        """From now on `part_logits` computes the shard's columns [first, last) only (`offset`: the shard's first
        row of the stored tensor `name`)."""
        raise NotImplementedError

    def part_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [M, hidden] -> logits [M, last - first] of the columns `split` chose, each as `logits` computes
        it (in the kernel's dtype: the caller converts)."""
        raise NotImplementedError

    def refine(self, hidden: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """The shard's joined logits [M, shard rows] (float32) as `logits` would return them."""
        return logits

    def describe(self) -> str:
        raise NotImplementedError


class FloatHead(HeadMethod):
    """W [hidden, shard rows] in the model dtype: a transposed copy even when tied, for the faster x @ W."""

    def __init__(self, hidden: int, rows: int, dtype: torch.dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(hidden, rows, dtype=dtype), requires_grad=False)
        self.first, self.last = 0, rows

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (hidden @ self.weight).float()

    def split(self, source: WeightSource, name: str, offset: int, first: int, last: int) -> None:
        self.first, self.last = first, last  # a view of the loaded weight: nothing loaded again

    def part_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.weight[:, self.first : self.last]

    def describe(self) -> str:
        return f"{str(self.weight.dtype).removeprefix('torch.')} {list(self.weight.shape)}"


class RefinedInt8Rows(HeadMethod):
    """The stored Q8_0 rows in the int4 kernel, each row's best logits recomputed in float32 (refined_head.py)."""

    def __init__(self, head: RefinedInt8Head):
        super().__init__()
        self.head = head
        self.part: Int4Linear | None = None
        """This PCP rank's rows in the same kernel, once `split`."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)

    def split(self, source: WeightSource, name: str, offset: int, first: int, last: int) -> None:
        self.part = Int4Linear.from_int8(source.get_int8_groups(name, dim=0, start=offset + first, end=offset + last))
        self.head.kernel = None  # every step now takes the split: only the stored rows (refinement) stay in use

    def part_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.part(hidden)

    def refine(self, hidden: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        return self.head.refine(hidden, logits)

    def describe(self) -> str:
        return f"int8 rows in the int4 kernel, the best {REFINED} logits of each row refined in float32"
