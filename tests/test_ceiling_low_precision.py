"""`cpllm bench ceiling`'s bf16 and int8 matmul rates (cpllm/bench/ceiling.py)."""

from __future__ import annotations

import pytest
import torch

from cpllm.bench.ceiling import matmul_gflops, measure_ceilings


def test_low_precision_rates_are_measured_only_when_asked():
    (plain,) = measure_ceilings([1], size=64).values()
    (full,) = measure_ceilings([1], size=64, low_precision=True).values()
    assert set(plain) == {"matmul_gflops", "matvec_gbps"}
    assert full["bf16_matmul_gflops"] > 0 and full["int8_matmul_gops"] > 0


def test_an_unmeasured_dtype_raises_naming_it():
    with pytest.raises(ValueError, match="float16"):
        matmul_gflops(1, size=32, dtype=torch.float16)
