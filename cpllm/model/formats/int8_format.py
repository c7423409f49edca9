"""The int8 format: 8-bit codes with a scale per 32 inputs (Q8_0's scheme; groups.py), as GGUF Q8_0 blocks are
stored or float weights quantized at load. Linears and experts run in the int4 kernel as two 4-bit halves
(GroupedWeight, GroupedExperts); an embedding keeps its rows as stored (StoredInt8Rows); a head runs in the kernel
with each row's best logits recomputed in float32 (RefinedInt8Rows)."""

from __future__ import annotations

import torch

from cpllm.model.formats.base import Ranges
from cpllm.model.formats.entry import WeightFormat
from cpllm.model.formats.embedding import EmbeddingRows, FloatRows, StoredInt8Rows
from cpllm.model.formats.experts import ExpertReader, FloatExperts, GroupedExperts, MXFP4Weight
from cpllm.model.formats.float_weight import FloatWeight
from cpllm.model.formats.group_kernels import Int4Linear, Int8Rows
from cpllm.model.formats.group_load import int8_kernel
from cpllm.model.formats.grouped import GroupedWeight
from cpllm.model.formats.lm_head import FloatHead, RefinedInt8Rows
from cpllm.model.formats.mxfp4 import int8_groups
from cpllm.model.formats.refined_head import RefinedInt8Head
from cpllm.model.loaders.loader import WeightSource


def load_linear(source: WeightSource, ranges: Ranges, dim: int, empty: FloatWeight | None, dtype: torch.dtype
                ) -> GroupedWeight:
    return GroupedWeight(int8_kernel(source, ranges, dim=dim))


def load_rows(source: WeightSource, name: str, start: int, end: int, empty: FloatRows) -> StoredInt8Rows:
    rows = Int8Rows(source.get_int8_groups(name, dim=0, start=start, end=end))
    return StoredInt8Rows(rows, empty.weight.dtype)


def load_head(source: WeightSource, name: str, start: int, end: int, empty: FloatHead,
              tied: EmbeddingRows | None) -> RefinedInt8Rows:
    shared = tied.int8_rows() if tied is not None else None  # the same rows: one copy
    groups = source.get_int8_groups(name, dim=0, start=start, end=end)
    return RefinedInt8Rows(RefinedInt8Head(groups, shared))


def _mxfp4_kernel(weight: MXFP4Weight) -> Int4Linear:
    # the blocks' exact 8-bit form (cpllm/model/formats/mxfp4.py)
    return Int4Linear.from_int8(int8_groups(weight.blocks, weight.scales))


def load_experts(reader: ExpertReader, empty: FloatExperts) -> GroupedExperts:
    return GroupedExperts.from_mxfp4(reader, empty.gate_up.shape[0], _mxfp4_kernel, "int8")


INT8_FORMAT = WeightFormat(name="int8", load_linear=load_linear, load_rows=load_rows, load_head=load_head,
                           load_experts=load_experts)
