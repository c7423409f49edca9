"""The float format: weights in the model dtype (dequantized where stored quantized), the only one under
quantization=none. Its linears are FloatWeight (prepacked for oneDNN where nothing reads them in place), its
embedding FloatRows, its head FloatHead, its experts FloatExperts (prepacked for oneDNN where it packs)."""

from __future__ import annotations

import torch

from cpllm.model.formats.base import Ranges
from cpllm.model.formats.entry import WeightFormat
from cpllm.model.formats.embedding import EmbeddingRows, FloatRows
from cpllm.model.formats.experts import ExpertMethod, ExpertReader, FloatExperts
from cpllm.model.formats.float_weight import FloatWeight
from cpllm.model.formats.lm_head import FloatHead
from cpllm.model.formats.modes import FLOAT
from cpllm.model.loaders.loader import WeightSource


def load_linear(source: WeightSource, ranges: Ranges, dim: int, empty: FloatWeight | None, dtype: torch.dtype
                ) -> FloatWeight:
    if empty is not None:  # every part in float: filled in place, nothing more allocated
        empty.fill(source, ranges, dim)
        return empty
    # a float run beside quantized ones (only packed rows mix formats: one input shard is one tensor)
    rows = [source.get(name, dim=0, start=start, end=end, dtype=dtype) for name, start, end in ranges]
    return FloatWeight(torch.cat(rows).t().contiguous())


def load_rows(source: WeightSource, name: str, start: int, end: int, empty: FloatRows) -> FloatRows:
    empty.weight.copy_(source.get(name, dim=0, start=start, end=end, dtype=empty.weight.dtype))
    return empty


def load_head(source: WeightSource, name: str, start: int, end: int, empty: FloatHead,
              tied: EmbeddingRows | None) -> FloatHead:
    rows = tied.float_rows() if tied is not None else None
    if rows is not None:
        empty.weight.copy_(rows.t())
    else:  # untied, or tied to an embedding that keeps its int8 rows
        empty.weight.copy_(source.get(name, dim=0, start=start, end=end, dtype=empty.weight.dtype).t())
    return empty


def load_experts(reader: ExpertReader, empty: FloatExperts) -> ExpertMethod:
    empty.fill(reader)
    return empty.prepacked()


FLOAT_FORMAT = WeightFormat(name=FLOAT, load_linear=load_linear, load_rows=load_rows, load_head=load_head,
                            load_experts=load_experts)
