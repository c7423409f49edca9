"""Reading weights from a WeightSource into the format their plan chose (int8 or int4 groups), one TP shard."""

from __future__ import annotations

import torch

from cpllm.model.loaders.loader import WeightSource
from cpllm.model.formats.groups import Int4Groups, Int8Groups, quantize_int4, quantize_int8
from cpllm.model.formats.group_kernels import Int4Linear
from cpllm.model.formats.plan import INT4_STORAGE, INT8_STORAGE


def read_int4(source: WeightSource, name: str, *, dim: int, start: int, end: int) -> Int4Groups:
    """Rows (dim 0) or group-aligned columns (dim 1) of a weight as 4-bit groups: stored blocks when the source
    holds them (nothing dequantized), else the float weight quantized here (groups lie inside any aligned slice)."""
    if source.storage_type(name) in INT4_STORAGE:
        return source.get_int4_groups(name, dim=dim, start=start, end=end)
    return quantize_int4(source.get(name, dim=dim, start=start, end=end, dtype=torch.float32))


def read_int8(source: WeightSource, name: str, *, dim: int, start: int, end: int) -> Int8Groups:
    """As read_int4, for 8-bit groups (Q8_0 blocks as stored, or float weights quantized here)."""
    if source.storage_type(name) in INT8_STORAGE:
        return source.get_int8_groups(name, dim=dim, start=start, end=end)
    return quantize_int8(source.get(name, dim=dim, start=start, end=end, dtype=torch.float32))


def int4_kernel(source: WeightSource, parts: list[tuple[str, int, int]], *, dim: int = 0) -> Int4Linear:
    """Slices [(name, start, end)] along `dim` (0: output rows, packed in order; 1: one group-aligned input
    shard) as one int4 kernel over 4-bit groups."""
    return Int4Linear(Int4Groups.cat_rows([read_int4(source, n, dim=dim, start=s, end=e) for n, s, e in parts]))


def int8_kernel(source: WeightSource, parts: list[tuple[str, int, int]], *, dim: int = 0) -> Int4Linear:
    """As int4_kernel, over 8-bit groups held as two 4-bit halves."""
    return Int4Linear.from_int8(Int8Groups.cat_rows([read_int8(source, n, dim=dim, start=s, end=e)
                                                     for n, s, e in parts]))
