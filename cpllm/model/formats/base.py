"""The interfaces of the weight formats: a format's registry entry (WeightFormat), and the method every format of a
linear layer implements (LinearMethod; see the package docstring)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:
    from cpllm.model.formats.embedding import EmbeddingRows, FloatRows
    from cpllm.model.formats.experts import ExpertMethod, ExpertReader, FloatExperts
    from cpllm.model.formats.float_weight import FloatWeight
    from cpllm.model.formats.lm_head import FloatHead, HeadMethod
    from cpllm.model.loader import WeightSource

Ranges = list[tuple[str, int, int]]
"""[(tensor name, start, end)]: slices of stored tensors along one dimension."""


@dataclass(frozen=True, slots=True)
class FusedWeight:
    """How the fused decode layer (cpllm/model/fused_decode.py) reads one linear: a single kernel over one tensor."""

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


@dataclass(kw_only=True, frozen=True, slots=True)
class WeightFormat:
    """One weight format, as the registry (registry.py) holds it: how a tensor planned in it is built, for each
    role it can fill. What is built then multiplies (`matmul`, the format's apply), describes itself (`describe`)
    and gives the fused decode layer its spec (`fused_spec`): the format owns all four."""

    name: str
    """The registry key: the `format` of a plan (plan.py) and the start-up log's bytes bucket."""
    load_linear: Callable[[WeightSource, Ranges, int, FloatWeight | None, torch.dtype], LinearMethod]
    """(source, ranges, dim, empty, dtype) -> the method over slices of stored tensors along `dim` (0: output rows
    packed in order; 1: one tensor's input columns). `empty` is the linear's unloaded float weight when these
    ranges are all of it (the float format fills it in place), else None; `dtype` is the model's."""
    load_rows: Callable[[WeightSource, str, int, int, FloatRows], EmbeddingRows] | None
    """(source, name, start, end, empty) -> vocabulary rows [start, end) of a token embedding (`empty` filled in
    place by the float format); None where the format holds no embedding."""
    load_head: Callable[[WeightSource, str, int, int, FloatHead, EmbeddingRows | None], HeadMethod] | None
    """(source, name, start, end, empty, tied) -> an LM head over vocabulary rows [start, end) (`tied`: the
    embedding's loaded rows, shared or copied where they can be); None where the format holds no head."""
    load_experts: Callable[[ExpertReader, FloatExperts], ExpertMethod] | None
    """(reader, empty) -> a rank's routed experts (`empty`: their unloaded float stacks, filled in place by the float
    format); None where the format holds no experts."""
