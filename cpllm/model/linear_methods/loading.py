"""Which method each linear's weight gets, and its loading: the plan (cpllm/model/quant_plan.py) per stored tensor,
then one method per run of parts sharing a format."""

from __future__ import annotations

import torch

from cpllm.model.linear_methods.base import LinearMethod
from cpllm.model.linear_methods.concatenated import ConcatenatedWeights
from cpllm.model.linear_methods.embedding import EmbeddingRows, FloatRows, StoredInt8Rows
from cpllm.model.linear_methods.float_weight import FloatWeight, Ranges
from cpllm.model.linear_methods.grouped import GroupedWeight
from cpllm.model.linear_methods.lm_head import FloatHead, HeadMethod, RefinedInt8Rows
from cpllm.model.loader import WeightSource
from cpllm.model.quant_kernels import Int8Rows
from cpllm.model.quant_lm_head import RefinedInt8Head
from cpllm.model.quant_load import quantized_linear
from cpllm.model.quant_plan import NOT_QUANTIZED, WeightPlan, embedding_plan, lm_head_plan, plan_packed


def load_linear(source: WeightSource, ranges: Ranges, dim: int, empty: FloatWeight, quantization: str
                ) -> tuple[LinearMethod, list[WeightPlan]]:
    """(method, plan per range) for slices of stored tensors along `dim`: 0, output rows packed in order (q|k|v,
    gate|up); 1, one tensor's input columns (a row-parallel shard: its groups never cross the shard's edges, so
    they are one rank's groups). `empty` is the linear's unloaded float weight, filled in place when every part
    runs in float (the plain path allocates nothing more)."""
    runs = [("float", list(range(len(ranges))))]
    plans = [NOT_QUANTIZED] * len(ranges)
    if quantization != "none":
        stored = [source.storage_type(name) for name, _, _ in ranges]
        plans, runs = plan_packed(quantization, stored, empty.in_features, cpu=empty.on_cpu)
    if all(fmt == "float" for fmt, _ in runs):
        empty.fill(source, ranges, dim)
        return empty, plans
    methods = [_load_run(source, fmt, [ranges[i] for i in idx], dim, empty.weight.dtype) for fmt, idx in runs]
    return (methods[0] if len(methods) == 1 else ConcatenatedWeights(methods)), plans


def _load_run(source: WeightSource, fmt: str, ranges: Ranges, dim: int, dtype: torch.dtype) -> LinearMethod:
    if fmt != "float":
        return GroupedWeight(quantized_linear(source, fmt, ranges, dim=dim))
    # a float run beside quantized ones (only packed rows mix formats: one input shard is one tensor)
    rows = [source.get(name, dim=0, start=start, end=end, dtype=dtype) for name, start, end in ranges]
    return FloatWeight(torch.cat(rows).t().contiguous())


def load_embedding(source: WeightSource, name: str, start: int, end: int, empty: FloatRows, quantization: str
                   ) -> tuple[EmbeddingRows, WeightPlan]:
    """(rows, plan) of vocabulary rows [start, end) of `name`; `empty` is filled in place unless they stay int8."""
    plan = NOT_QUANTIZED if quantization == "none" else embedding_plan(quantization, source.storage_type(name))
    if plan.format == "int8":
        rows = Int8Rows(source.get_int8_groups(name, dim=0, start=start, end=end))
        return StoredInt8Rows(rows, empty.weight.dtype), plan
    empty.weight.copy_(source.get(name, dim=0, start=start, end=end, dtype=empty.weight.dtype))
    return empty, plan


def load_head(source: WeightSource, name: str, start: int, end: int, empty: FloatHead,
              tied: EmbeddingRows | None, quantization: str) -> tuple[HeadMethod, WeightPlan]:
    """(method, plan) of vocabulary rows [start, end) of `name` (the embedding's tensor when tied: its rows,
    already loaded, are shared or copied rather than read again where they can be)."""
    plan = NOT_QUANTIZED if quantization == "none" else lm_head_plan(
        quantization, source.storage_type(name), cpu=empty.weight.device.type == "cpu")
    if plan.format == "int8":
        shared = tied.int8_rows() if tied is not None else None  # the same rows: one copy
        groups = source.get_int8_groups(name, dim=0, start=start, end=end)
        return RefinedInt8Rows(RefinedInt8Head(groups, shared)), plan
    rows = tied.float_rows() if tied is not None else None
    if rows is not None:
        empty.weight.copy_(rows.t())
    else:  # untied, or tied to an embedding that keeps its int8 rows
        empty.weight.copy_(source.get(name, dim=0, start=start, end=end, dtype=empty.weight.dtype).t())
    return empty, plan
