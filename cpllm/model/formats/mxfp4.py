"""MXFP4, the format of the released GPT-OSS checkpoints' expert weights: 4-bit floats in blocks of 32 with one
power-of-two scale per block (the OCP microscaling format).

Stored per weight of HF layout [..., out, in] (the checkpoint's `*_blocks` / `*_scales` tensors):
- blocks uint8 [..., out, in / 32, 16]: two FP4 (e2m1) codes per byte, element 2j in the low nibble, 2j + 1 in
  the high one. A code is sign (bit 3) and magnitude (bits 0-2) indexing 0, 0.5, 1, 1.5, 2, 3, 4, 6.
- scales uint8 [..., out, in / 32]: e8m0, the block's factor 2^(s - 127).
Every value is exact in float32 (and bfloat16): a magnitude has at most 2 significant bits.

Since every FP4 magnitude is a multiple of 0.5 and at most 6, a block is also exactly an int8 group of Q8_0's
form (cpllm/model/formats/groups.py): codes 2 x value in -12..12, step 2^(s - 128). `int8_groups` gives that form;
`int4_groups` re-quantizes the dequantized block to the int4 kernel's uniform 4-bit groups (not exact: FP4's
levels are not evenly spaced).
"""

from __future__ import annotations

import torch

from cpllm.model.formats.groups import Int4Groups, Int8Groups, quantize_int4

BLOCK = 32
"""Values per scale."""
FP4_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""e2m1 magnitude of codes 0..7; codes 8..15 are the same, negated."""
SCALE_BIAS = 127
"""The e8m0 scale byte s means 2^(s - SCALE_BIAS)."""


def fp4_table(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The value of each of the 16 codes, [16]."""
    magnitudes = torch.tensor(FP4_MAGNITUDES, dtype=dtype)
    return torch.cat((magnitudes, -magnitudes))


def _codes(blocks: torch.Tensor) -> torch.Tensor:
    # blocks uint8 [..., G, 16] -> codes long [..., G, 32], element order restored (low nibble first)
    low, high = (blocks & 0x0F).long(), (blocks >> 4).long()
    return torch.stack((low, high), dim=-1).flatten(-2)


def _check(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} need shape scales.shape + ({BLOCK // 2},); "
                         f"scales are {tuple(scales.shape)}")


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks [..., out, G, 16], scales [..., out, G] -> the weight [..., out, G * 32] in `dtype` (exact for
    float32 and bfloat16 unless a scale leaves the dtype's range)."""
    _check(blocks, scales)
    values = fp4_table()[_codes(blocks)]  # [..., out, G, 32] float32
    exponent = scales.to(torch.int32) - SCALE_BIAS
    values = torch.ldexp(values, exponent.unsqueeze(-1).float())
    return values.flatten(-2).to(dtype)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [..., out, in] (in a multiple of 32) -> (blocks, scales) in the stored form.

    Each block's exponent is the smallest that brings its largest magnitude to at most 6 (FP4's largest), and each
    value is rounded to the nearest FP4 level (ties to the lower magnitude). Used to build test checkpoints."""
    *lead, cols = weight.shape
    if cols % BLOCK != 0:
        raise ValueError(f"MXFP4 needs an input width that is a multiple of {BLOCK}, got {cols}")
    w = weight.float().reshape(*lead, cols // BLOCK, BLOCK)
    amax = w.abs().amax(-1)  # [..., G]
    exponent = torch.ceil(torch.log2(torch.where(amax > 0, amax, torch.ones_like(amax)) / 6.0))
    exponent = exponent.clamp(-SCALE_BIAS, 254 - SCALE_BIAS)
    scaled = torch.ldexp(w, -exponent.unsqueeze(-1)).abs()  # [..., G, 32], at most 6
    levels = torch.tensor(FP4_MAGNITUDES)
    magnitude = (scaled.unsqueeze(-1) - levels).abs().argmin(-1)  # nearest level, the first on a tie
    codes = magnitude | ((w < 0) & (magnitude > 0)).long() << 3
    codes = codes.reshape(*lead, cols // BLOCK, BLOCK // 2, 2)
    blocks = (codes[..., 0] | codes[..., 1] << 4).to(torch.uint8)
    return blocks, (exponent + SCALE_BIAS).to(torch.uint8)


def int8_groups(blocks: torch.Tensor, scales: torch.Tensor) -> Int8Groups:
    """One weight's blocks [out, G, 16] and scales [out, G] as exact 8-bit groups (codes 2 x FP4 value, step
    2^(s - 128)): the same numbers, in the format the int4 kernel runs as two 4-bit halves."""
    _check(blocks, scales)
    codes = (2 * fp4_table()[_codes(blocks)]).to(torch.int8).flatten(-2)  # [out, in]
    d = torch.ldexp(torch.ones(scales.shape), scales.to(torch.int32).float() - (SCALE_BIAS + 1))
    return Int8Groups(codes=codes, d=d)


def int4_groups(blocks: torch.Tensor, scales: torch.Tensor) -> Int4Groups:
    """One weight's blocks as the int4 kernel's 4-bit groups (min/max re-quantized per 32: lossy, see the module)."""
    return quantize_int4(dequantize_mxfp4(blocks, scales))
