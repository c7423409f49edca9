"""Which method each weight gets, and its loading: the plan (plan.py) per stored tensor, then the planned format's
entry in the registry (registry.py) builds it, one method per run of packed parts sharing a format."""

from __future__ import annotations

from typing import Callable, TypeVar

from cpllm.model.formats.base import LinearMethod, Ranges
from cpllm.model.formats.concatenated import ConcatenatedWeights
from cpllm.model.formats.embedding import EmbeddingRows, FloatRows
from cpllm.model.formats.experts import ExpertMethod, ExpertReader, FloatExperts
from cpllm.model.formats.float_weight import FloatWeight
from cpllm.model.formats.lm_head import FloatHead, HeadMethod
from cpllm.model.formats.modes import quantization_mode
from cpllm.model.formats.plan import NOT_QUANTIZED, WeightPlan, embedding_plan, lm_head_plan, plan_packed
from cpllm.model.formats.registry import weight_format
from cpllm.model.loaders.loader import WeightSource


Loader = TypeVar("Loader", bound=Callable)


def _held(load: Loader | None, plan: WeightPlan, role: str) -> Loader:
    """`load`, the planned format's loader for `role`; a ValueError where the format has none."""
    if load is None:
        raise ValueError(f"weight format {plan.format!r} holds no {role} (planned: {plan.reason})")
    return load


def load_linear(source: WeightSource, ranges: Ranges, dim: int, empty: FloatWeight, quantization: str
                ) -> tuple[LinearMethod, list[WeightPlan]]:
    """(method, plan per range) for slices of stored tensors along `dim`: 0, output rows packed in order (q|k|v,
    gate|up); 1, one tensor's input columns (a row-parallel shard: its groups never cross the shard's edges, so
    they are one rank's groups). `empty` is the linear's unloaded float weight, filled in place when every part
    runs in float (the plain path allocates nothing more)."""
    plans = [NOT_QUANTIZED] * len(ranges)
    runs = [(NOT_QUANTIZED, list(range(len(ranges))))]
    if quantization_mode(quantization).quantizes:  # else no storage type is looked at
        stored = [source.storage_type(name) for name, _, _ in ranges]
        plans, fmt_runs = plan_packed(quantization, stored, empty.in_features, cpu=empty.on_cpu)
        runs = [(plans[idx[0]], idx) for _, idx in fmt_runs]
    dtype = empty.weight.dtype
    if len(runs) == 1:
        return weight_format(runs[0][0].format).load_linear(source, ranges, dim, empty, dtype), plans
    methods = [weight_format(plan.format).load_linear(source, [ranges[i] for i in idx], dim, None, dtype)
               for plan, idx in runs]
    return ConcatenatedWeights(methods), plans


def load_embedding(source: WeightSource, name: str, start: int, end: int, empty: FloatRows, quantization: str
                   ) -> tuple[EmbeddingRows, WeightPlan]:
    """(rows, plan) of vocabulary rows [start, end) of `name`; `empty` is filled in place unless they stay int8."""
    plan = (embedding_plan(quantization, source.storage_type(name)) if quantization_mode(quantization).quantizes
            else NOT_QUANTIZED)
    load = _held(weight_format(plan.format).load_rows, plan, "embedding")
    return load(source, name, start, end, empty), plan


def load_head(source: WeightSource, name: str, start: int, end: int, empty: FloatHead,
              tied: EmbeddingRows | None, quantization: str) -> tuple[HeadMethod, WeightPlan]:
    """(method, plan) of vocabulary rows [start, end) of `name` (the embedding's tensor when tied: its rows,
    already loaded, are shared or copied rather than read again where they can be)."""
    plan = (lm_head_plan(quantization, source.storage_type(name), cpu=empty.weight.device.type == "cpu")
            if quantization_mode(quantization).quantizes else NOT_QUANTIZED)
    load = _held(weight_format(plan.format).load_head, plan, "LM head")
    return load(source, name, start, end, empty, tied), plan


def load_experts(reader: ExpertReader, empty: FloatExperts, plan: WeightPlan = NOT_QUANTIZED) -> ExpertMethod:
    """A rank's routed experts in the format `plan` chose (float unless given: experts.py's families with float
    checkpoints), from what `reader` reads; `empty`, their unloaded float stacks, filled in place in float."""
    load = _held(weight_format(plan.format).load_experts, plan, "routed experts")
    return load(reader, empty)
