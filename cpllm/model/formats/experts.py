"""Expert methods: the routed experts one rank holds, as one object per expert stack that knows its format.

An expert block (cpllm/model/moe/experts.py, cpllm/model/moe/gpt_oss_block.py) keeps the routing, the activation and
the biases; its weights are one ExpertMethod, built at load by the format its plan chose (registry.py), and asked,
never probed:

    matmul(e, x, which)   held expert e's gate|up (which 0) or down (1) product, x [count, in] -> [count, out]
    describe()            what it runs, for logs
    fused_spec()          None: no fused decode layer reads routed experts
    plain_weights()       (gate|up [n, hidden, 2 rows], down [n, rows, hidden]) as loaded, where held in float
    nbytes                the bytes it holds

Formats: FloatExperts (plain [in, out] stacks, filled in place at load), OneDNNExperts (the same weights prepacked
per expert for oneDNN, packed_weights.py, where it packs: the plain stacks are then dropped) and GroupedExperts
(one int4 kernel per expert and weight: 4-bit groups, or 8-bit groups as two 4-bit halves).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from cpllm.model.formats import packed_weights
from cpllm.model.formats.base import FusedWeight
from cpllm.model.formats.group_kernels import Int4Linear


@dataclass(kw_only=True, frozen=True, slots=True)
class MXFP4Weight:
    """One expert's weight as MXFP4 blocks (cpllm/model/formats/mxfp4.py), the rows and groups this rank holds."""

    blocks: torch.Tensor
    """uint8 [out, in / 32, 16]."""
    scales: torch.Tensor
    """uint8 [out, in / 32]."""


class ExpertReader(Protocol):
    """What a family reads of its held experts (each stores them its own way); the format builds from it."""

    def fill_floats(self, expert: int, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        """Held expert `expert`'s weights in the model dtype, written into gate|up [hidden, 2 rows] (gate rows, then
        up rows) and down [rows, hidden]."""

    def mxfp4(self, expert: int) -> tuple[MXFP4Weight, MXFP4Weight]:
        """Held expert `expert`'s (gate|up, down) as stored blocks: gate|up's rows in the order of fill_floats'
        columns, down's input groups of this rank's rows."""


class ExpertMethod(torch.nn.Module):
    """One format of a rank's stack of routed experts (see the module)."""

    weight_format = "float"
    """The start-up log's bucket (cpllm/model/formats/report.py) and the registry key of the format."""

    def matmul(self, expert: int, x: torch.Tensor, which: int) -> torch.Tensor:
        """x [count, in] -> held expert `expert`'s gate|up (which = 0) or down (1) product [count, out]."""
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    def fused_spec(self) -> FusedWeight | None:
        """None: the fused decode layers run dense MLPs only."""
        return None

    def plain_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate|up [n, hidden, 2 rows], down [n, rows, hidden]) as loaded, whichever way they are held."""
        raise ValueError(f"experts held as {self.describe()} have no plain float weights")

    @property
    def nbytes(self) -> int:
        raise NotImplementedError


class FloatExperts(ExpertMethod):
    """Stacks in the model dtype, stored transposed ([in, out]) like the dense layers: x @ W."""

    def __init__(self, num_experts: int, hidden: int, rows: int, dtype: torch.dtype):
        """Unloaded, on the default device (the block's device)."""
        super().__init__()
        self.gate_up = torch.nn.Parameter(torch.empty(num_experts, hidden, 2 * rows, dtype=dtype), requires_grad=False)
        self.down = torch.nn.Parameter(torch.empty(num_experts, rows, hidden, dtype=dtype), requires_grad=False)

    def fill(self, reader: ExpertReader) -> None:
        for i in range(self.gate_up.shape[0]):
            reader.fill_floats(i, self.gate_up[i], self.down[i])

    def matmul(self, expert: int, x: torch.Tensor, which: int) -> torch.Tensor:
        return x @ (self.gate_up if which == 0 else self.down)[expert]

    def describe(self) -> str:
        n, hidden, width = self.gate_up.shape
        return f"{str(self.gate_up.dtype).removeprefix('torch.')} x{n} [{hidden} -> {width} -> {hidden}]"

    def plain_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gate_up, self.down

    @property
    def nbytes(self) -> int:
        return sum(w.numel() * w.element_size() for w in (self.gate_up, self.down))

    def prepacked(self) -> ExpertMethod:
        """The same experts in oneDNN's layout where it packs (the plain stacks are then dropped), else `self`."""
        if not packed_weights.packs(self.gate_up.dtype, self.gate_up.device):
            return self
        return OneDNNExperts([(packed_weights.pack(g.t()), packed_weights.pack(d.t()))
                              for g, d in zip(self.gate_up, self.down)])


class OneDNNExperts(ExpertMethod):
    """Per expert (gate|up [2 rows, hidden], down [hidden, rows]) in oneDNN's layout, multiplied by its matmul."""

    def __init__(self, packed: list[tuple[torch.Tensor, torch.Tensor]]):
        super().__init__()
        self.packed = packed
        """A plain list, as the experts held it before: the packed tensors are not module buffers."""

    def matmul(self, expert: int, x: torch.Tensor, which: int) -> torch.Tensor:
        return packed_weights.matmul(x, self.packed[expert][which])

    def describe(self) -> str:
        return f"{str(self.packed[0][0].dtype).removeprefix('torch.')} x{len(self.packed)}, oneDNN prepacked"

    def plain_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.stack([packed_weights.unpack(g).t() for g, _ in self.packed]),
                torch.stack([packed_weights.unpack(d).t() for _, d in self.packed]))

    @property
    def nbytes(self) -> int:
        return sum(w.numel() * w.element_size() for pair in self.packed for w in pair)


class GroupedExperts(ExpertMethod):
    """Per expert (gate|up, down) int4 kernels: 4-bit groups ("int4"), or 8-bit groups as two halves ("int8")."""

    def __init__(self, kernels: list[tuple[Int4Linear, Int4Linear]], weight_format: str):
        super().__init__()
        self.kernels = torch.nn.ModuleList(torch.nn.ModuleList(pair) for pair in kernels)
        self.weight_format = weight_format

    @classmethod
    def from_mxfp4(cls, reader: ExpertReader, num_experts: int, kernel, weight_format: str) -> "GroupedExperts":
        """Every expert's MXFP4 (gate|up, down) blocks, one expert at a time, each made a kernel by `kernel`
        (MXFP4Weight -> Int4Linear)."""
        kernels = []
        for i in range(num_experts):
            gate_up, down = reader.mxfp4(i)
            kernels.append((kernel(gate_up), kernel(down)))
        return cls(kernels, weight_format)

    def matmul(self, expert: int, x: torch.Tensor, which: int) -> torch.Tensor:
        return self.kernels[expert][which](x.contiguous())

    def describe(self) -> str:
        backends = sorted({kernel.backend for pair in self.kernels for kernel in pair})
        return f"{self.weight_format} groups of 32 x{len(self.kernels)}, {'/'.join(backends)} kernel"

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.kernels.buffers())
