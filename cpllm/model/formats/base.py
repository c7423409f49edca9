"""The interface every weight format of a linear layer implements (LinearMethod; see the package docstring); a
format's registry entry is entry.py's WeightFormat."""

from __future__ import annotations

from dataclasses import dataclass

import torch

Ranges = list[tuple[str, int, int]]
"""[(tensor name, start, end)]: slices of stored tensors along one dimension."""


@dataclass(frozen=True, slots=True)
class FusedWeight:
    """How the fused decode layer (cpllm/model/execution/fused_decode.py) reads one linear: a single kernel over one tensor."""

    kind: str
    """"int4" (the VNNI kernel's packed 4-bit groups) or "float32" (a plain [in, out] float32 weight)."""
    tensor: torch.Tensor
    """The tensor whose address the C layer reads in place."""


class LinearMethod(torch.nn.Module):
    """One weight format of one linear: it holds the weight in that format and multiplies by it.

    A module, so that its tensors move, count and compile as the model's (a graph compiled for one layer serves every
    layer: their methods' tensors are inputs). The multiply is `matmul`, not `forward` or `apply`: a linear calls it
    directly, without the module-call machinery, and `torch.nn.Module.apply` keeps its meaning.
    """

    weight_format = "float"
    """The registry key of its format ("float", "int8", "int4"): the bucket of the start-up log's weight bytes
    (cpllm/model/formats/report.py)."""

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [N, in] -> x W^T (+ bias) [N, out]."""
        raise NotImplementedError

    def matmul_native(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """`matmul`, returned in the dtype the product was rounded to where that is narrower than x's (a bfloat16
        GEMM's output, not widened back), for a consumer that reads it as it is; by default `matmul` itself."""
        return self.matmul(x, bias)

    def input_dtype(self, rows: int) -> torch.dtype | None:
        """The dtype a `matmul` of `rows` rows rounds its input to before any arithmetic (so a producer may round
        to it itself, sparing a wide intermediate), or None where the input is read as given (the default)."""
        return None

    def describe(self) -> str:
        """What this method runs, for logs (e.g. "float32 [576, 1536]", "int4, VNNI kernel")."""
        raise NotImplementedError

    def fused_spec(self) -> FusedWeight | None:
        """The weight as the fused decode layer reads it, or None where it cannot (the default)."""
        return None

    def columns(self, start: int, end: int) -> torch.Tensor | None:
        """A view [in, end - start] of output columns [start, end) of a plain weight, or None where the format holds
        none (the default): a caller then loads the slice in the same format itself."""
        return None

    def prepacked(self) -> "LinearMethod":
        """The same weight in the layout that multiplies fastest here, for a weight nothing else reads in place (the
        fused decode layers read theirs); `self` where there is none (the default)."""
        return self
