"""The int4 format: 4-bit codes with a step and an offset per 32 inputs (groups.py), as GGUF Q4_0 / Q4_1 / Q4_K
blocks are stored or float weights quantized at load, run in the int4 kernel (GroupedWeight). Routed experts
stored as MXFP4 blocks are re-quantized to it (lossy: FP4's levels are not evenly spaced). It holds no embedding
and no head: the plans (plan.py) never put one in it."""

from __future__ import annotations

import torch

from cpllm.model.formats.base import Ranges
from cpllm.model.formats.entry import WeightFormat
from cpllm.model.formats.experts import ExpertReader, FloatExperts, GroupedExperts, MXFP4Weight
from cpllm.model.formats.float_weight import FloatWeight
from cpllm.model.formats.group_kernels import Int4Linear
from cpllm.model.formats.group_load import int4_kernel
from cpllm.model.formats.grouped import GroupedWeight
from cpllm.model.formats.mxfp4 import int4_groups
from cpllm.model.loaders.loader import WeightSource


def load_linear(source: WeightSource, ranges: Ranges, dim: int, empty: FloatWeight | None, dtype: torch.dtype
                ) -> GroupedWeight:
    return GroupedWeight(int4_kernel(source, ranges, dim=dim))


def _mxfp4_kernel(weight: MXFP4Weight) -> Int4Linear:
    return Int4Linear(int4_groups(weight.blocks, weight.scales))


def load_experts(reader: ExpertReader, empty: FloatExperts) -> GroupedExperts:
    return GroupedExperts.from_mxfp4(reader, empty.gate_up.shape[0], _mxfp4_kernel, "int4")


INT4_FORMAT = WeightFormat(name="int4", load_linear=load_linear, load_rows=None, load_head=None,
                           load_experts=load_experts)
