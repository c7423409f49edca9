"""Weights held as integer codes plus a scale (and offset) per 32 input columns, before they are packed for the
int4 kernel: 4-bit groups (GGUF Q4_0 / Q4_1 / Q4_K, or int4 quantization of a float weight) and 8-bit groups
(GGUF Q8_0, or int8 quantization of a float weight).

An 8-bit group runs in the same int4 kernel, exactly, as two 4-bit halves: with u = q + 128 = 16 h + l
(h, l in 0..15), w = d q = (16 d) h - 128 d + d l, i.e. a high half with step 16 d and a low half with step d,
side by side along the input (2x the columns; the input is fed twice). Measured on SmolLM2's 49,152 x 576 LM head
at batch 1 this beats aten's per-row int8 kernel (1.7 vs 2.7 ms at 2 threads, 3.3 vs 3.7 at 1), and unlike a
per-row scale it keeps Q8_0's values (per-row requantization measured 1.2% relative error on that matrix).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpllm.config.engine import QUANT_GROUP


@dataclass(frozen=True, slots=True)
class Int4Groups:
    """w[r, c] = d[r, g] * codes[r, c] + m[r, g], g = c // QUANT_GROUP (HF layout: rows are output features)."""

    codes: torch.Tensor
    """uint8 [rows, cols], values 0..15."""
    d: torch.Tensor
    """float32 [rows, cols / QUANT_GROUP], the step of each group."""
    m: torch.Tensor
    """float32 [rows, cols / QUANT_GROUP], the value of code 0 in each group."""

    def __post_init__(self) -> None:
        rows, cols = self.codes.shape
        if cols % QUANT_GROUP != 0 or self.d.shape != (rows, cols // QUANT_GROUP) or self.m.shape != self.d.shape:
            raise ValueError(
                f"codes {tuple(self.codes.shape)} need d and m of shape ({rows}, {cols // QUANT_GROUP}) and a "
                f"column count that is a multiple of {QUANT_GROUP}; got d {tuple(self.d.shape)}, m {tuple(self.m.shape)}"
            )

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, cols], the exact stored values (d * q is exact in float32 for f16 d and 4-bit q)."""
        d = self.d.repeat_interleave(QUANT_GROUP, dim=1)
        m = self.m.repeat_interleave(QUANT_GROUP, dim=1)
        return d * self.codes.float() + m

    def columns(self, start: int, end: int) -> "Int4Groups":
        """Columns [start, end); both must fall on group boundaries."""
        if start % QUANT_GROUP or end % QUANT_GROUP:
            raise ValueError(f"columns [{start}:{end}) do not fall on the {QUANT_GROUP}-column group boundaries")
        g0, g1 = start // QUANT_GROUP, end // QUANT_GROUP
        return Int4Groups(codes=self.codes[:, start:end], d=self.d[:, g0:g1], m=self.m[:, g0:g1])

    @staticmethod
    def cat_rows(parts: list["Int4Groups"]) -> "Int4Groups":
        """Row blocks stacked in order (the q|k|v and gate|up packing)."""
        return Int4Groups(codes=torch.cat([p.codes for p in parts]), d=torch.cat([p.d for p in parts]),
                          m=torch.cat([p.m for p in parts]))


def quantize_int4(weight: torch.Tensor) -> Int4Groups:
    """Asymmetric min/max quantization of a float weight [rows, cols] in groups of QUANT_GROUP columns.

    The kernel keeps its step and zero in bfloat16, so they are rounded first and the codes chosen against the
    rounded values: the codes then minimize the error of what the kernel will compute.
    """
    rows, cols = weight.shape
    if cols % QUANT_GROUP != 0:
        raise ValueError(f"int4 quantization needs a column count that is a multiple of {QUANT_GROUP}, got {cols}")
    w = weight.float().reshape(rows, cols // QUANT_GROUP, QUANT_GROUP)
    low, high = w.amin(-1), w.amax(-1)  # [rows, groups]
    step = ((high - low) / 15).to(torch.bfloat16).float()
    zero = (low + 8 * step).to(torch.bfloat16).float()  # the kernel's value of code 8
    safe = torch.where(step > 0, step, torch.ones_like(step))  # a constant group: every code 8 gives `zero`
    codes = torch.round((w - zero[..., None]) / safe[..., None] + 8).clamp_(0, 15)
    return Int4Groups(codes=codes.to(torch.uint8).reshape(rows, cols), d=step, m=zero - 8 * step)


@dataclass(frozen=True, slots=True)
class Int8Groups:
    """w[r, c] = d[r, g] * codes[r, c], g = c // QUANT_GROUP (GGUF Q8_0's form)."""

    codes: torch.Tensor
    """int8 [rows, cols]."""
    d: torch.Tensor
    """float32 [rows, cols / QUANT_GROUP]."""

    def __post_init__(self) -> None:
        rows, cols = self.codes.shape
        if cols % QUANT_GROUP != 0 or self.d.shape != (rows, cols // QUANT_GROUP):
            raise ValueError(f"codes {tuple(self.codes.shape)} need d of shape ({rows}, {cols // QUANT_GROUP}) and a "
                             f"column count that is a multiple of {QUANT_GROUP}; got d {tuple(self.d.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, cols], the exact stored values."""
        return self.codes.float() * self.d.repeat_interleave(QUANT_GROUP, dim=1)

    def columns(self, start: int, end: int) -> "Int8Groups":
        """Columns [start, end); both must fall on group boundaries."""
        if start % QUANT_GROUP or end % QUANT_GROUP:
            raise ValueError(f"columns [{start}:{end}) do not fall on the {QUANT_GROUP}-column group boundaries")
        return Int8Groups(codes=self.codes[:, start:end], d=self.d[:, start // QUANT_GROUP : end // QUANT_GROUP])

    @staticmethod
    def cat_rows(parts: list["Int8Groups"]) -> "Int8Groups":
        return Int8Groups(codes=torch.cat([p.codes for p in parts]), d=torch.cat([p.d for p in parts]))

    def as_int4_halves(self) -> Int4Groups:
        """The same weight as 4-bit groups over twice the columns: [high halves | low halves] (see the module)."""
        u = self.codes.to(torch.int16) + 128  # 0..255
        codes = torch.cat([u >> 4, u & 15], dim=1).to(torch.uint8)
        return Int4Groups(codes=codes, d=torch.cat([16 * self.d, self.d], dim=1),
                          m=torch.cat([-128 * self.d, torch.zeros_like(self.d)], dim=1))


def quantize_int8(weight: torch.Tensor) -> Int8Groups:
    """Symmetric int8 in groups of QUANT_GROUP columns (Q8_0's scheme): d = max|w| / 127 per group.

    d is rounded to bfloat16 first, the precision the kernel keeps, and the codes chosen against it.
    """
    rows, cols = weight.shape
    if cols % QUANT_GROUP != 0:
        raise ValueError(f"int8 quantization needs a column count that is a multiple of {QUANT_GROUP}, got {cols}")
    w = weight.float().reshape(rows, cols // QUANT_GROUP, QUANT_GROUP)
    d = (w.abs().amax(-1) / 127).to(torch.bfloat16).float()
    safe = torch.where(d > 0, d, torch.ones_like(d))  # an all-zero group: codes 0
    codes = torch.round(w / safe[..., None]).clamp_(-127, 127).to(torch.int8)
    return Int8Groups(codes=codes.reshape(rows, cols), d=d)
