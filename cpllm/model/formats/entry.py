"""A weight format's registry entry (registry.py holds one per format): how a tensor planned in the format is built
for each role it can fill."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from cpllm.model.formats.base import LinearMethod, Ranges

if TYPE_CHECKING:
    from cpllm.model.formats.embedding import EmbeddingRows, FloatRows
    from cpllm.model.formats.experts import ExpertMethod, ExpertReader, FloatExperts
    from cpllm.model.formats.float_weight import FloatWeight
    from cpllm.model.formats.lm_head import FloatHead, HeadMethod
    from cpllm.model.loaders.loader import WeightSource


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
