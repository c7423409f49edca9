"""The MXFP4 dequantizer (cpllm/model/formats/mxfp4.py) against transformers' own (integrations/mxfp4.py), on random
blocks holding every byte value, and the quantizer / int8-group forms built on it."""

from __future__ import annotations

import pytest
import torch

from cpllm.model.formats.mxfp4 import FP4_MAGNITUDES, dequantize_mxfp4, int4_groups, int8_groups, quantize_mxfp4


def random_blocks(experts: int, rows: int, groups: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (experts, rows, groups, 16), dtype=torch.uint8, generator=generator)
    scales = torch.randint(100, 150, (experts, rows, groups), dtype=torch.uint8, generator=generator)
    return blocks, scales


def test_dequantize_matches_transformers():
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    blocks, scales = random_blocks(3, 24, 4)
    assert len(torch.unique(blocks)) == 256  # every byte value, so every code in both nibbles
    for dtype in (torch.float32, torch.bfloat16):
        # transformers returns the [E, in, out] parameter; cpllm the stored [E, out, in] layout
        want = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=dtype)
        got = dequantize_mxfp4(blocks, scales, dtype)
        assert got.dtype == dtype and torch.equal(got.transpose(1, 2), want)


def test_quantize_round_trip():
    weight = 0.05 * torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(1))
    blocks, scales = quantize_mxfp4(weight)
    assert blocks.shape == (2, 16, 2, 16) and scales.shape == (2, 16, 2)
    values = dequantize_mxfp4(blocks, scales)
    # each value within half of the widest FP4 step (2, between 4 and 6) times its block's scale
    step = torch.ldexp(torch.ones(scales.shape), scales.int() - 127).repeat_interleave(32, dim=-1)
    assert torch.all((values - weight).abs() <= step)
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(values)), values)  # FP4 values quantize to themselves
    magnitudes = (values / step).abs().unique()
    assert set(magnitudes.tolist()) <= set(FP4_MAGNITUDES)


def test_int8_groups_are_exact_and_int4_groups_close():
    blocks, scales = random_blocks(1, 8, 4, seed=2)
    exact = dequantize_mxfp4(blocks[0], scales[0])
    assert torch.equal(int8_groups(blocks[0], scales[0]).dequantize(), exact)
    approx = int4_groups(blocks[0], scales[0]).dequantize()
    # 16 even levels over [min, max] of a block: within half a level (plus bfloat16 rounding of step and zero)
    spread = exact.view(8, 4, 32)
    level = ((spread.amax(-1) - spread.amin(-1)) / 15).repeat_interleave(32, dim=-1)
    assert torch.all((approx - exact).abs() <= 0.51 * level + 1e-2 * exact.abs().amax())


def test_bad_blocks_refused():
    blocks, scales = random_blocks(1, 2, 2)
    with pytest.raises(ValueError, match="uint8"):
        dequantize_mxfp4(blocks.int(), scales)
    with pytest.raises(ValueError, match="need shape"):
        dequantize_mxfp4(blocks[..., :8], scales)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp4(torch.zeros(4, 48))
