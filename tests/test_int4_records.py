"""The int4 layers' prefill GEMM fed straight from the int4 records: AMX tiles (cpllm/kernels/int4_amx.c) and
AVX-512 BF16 dot products (cpllm/kernels/int4_dpbf16.c), each tested where this CPU runs it.

Their result is the product of the bf16-rounded activations and the bf16-rounded weight (the other bf16 ways'
w = d q + m rounded once), accumulated in float32 and rounded to bf16 once: within half a bf16 step of that product
in float64. A row's result depends on that row alone. The shapes cover both kernels' tails: rows that fill no tile
or half of one (or fewer than the dot products' 8 rows), block counts that are odd or not a multiple of 3, a last
block of fewer than 16 outputs, one input group, several panels. Where neither runs the kernels decline (None) and
`dequantized_matmul` runs its oneDNN way, which the other int4 tests cover; the choice then never asks for them.
"""

from __future__ import annotations

import pytest
import torch
from test_int4_kernel import _groups

from cpllm.config.int4_threshold import NEVER
from cpllm.kernels import int4_choice, int4_gemm, int4_matmul, int4_records

kernels = pytest.mark.parametrize("kernel", [
    pytest.param(name, marks=pytest.mark.skipif(int4_records.kernel_here((name,)) is None,
                                                reason=f"{name} does not run on this CPU (or OS)"))
    for name in int4_records.KERNELS])
needs_one = pytest.mark.skipif(not int4_records.available(), reason="no record-fed kernel runs on this CPU")
BF16_HALF_STEP = 2.0**-8
"""Half the spacing of bf16 values relative to their magnitude: the output's one rounding."""


def _weight(out_features: int, in_features: int, seed: int = 0):
    groups = _groups(out_features, in_features, seed)
    return int4_matmul.pack(groups.codes, groups.d, groups.m)


def _exact(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """float64 x W^T on the bf16-rounded operands."""
    w = int4_gemm.dequantize(packed, out_features, dtype=torch.bfloat16)
    return x.to(torch.bfloat16).double() @ w.double().t()


@kernels
@pytest.mark.parametrize("rows", [1, 7, 15, 17, 32, 45, 100])
@pytest.mark.parametrize("out_features,in_features", [(96, 576), (200, 32), (48, 1536), (16, 64), (80, 64),
                                                      (400, 1536)])
def test_records_round_the_bf16_product_once(kernel, rows, out_features, in_features):
    packed = _weight(out_features, in_features, seed=rows)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    y = int4_records.matmul(x, packed, out_features, native=True, kernel=kernel)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, out_features)
    exact = _exact(x, packed, out_features)
    # float32 accumulation over `in_features` terms adds at most in_features * 2^-24 of the terms' magnitudes
    slack = in_features * 2.0**-23 * (x.to(torch.bfloat16).double().abs() @ _exact_abs_weight(packed, out_features))
    assert ((y.double() - exact).abs() <= BF16_HALF_STEP * exact.abs() + slack + 1e-30).all()
    widened = int4_records.matmul(x, packed, out_features, kernel=kernel)  # float32: the same bf16 values
    assert widened.dtype == torch.float32 and torch.equal(widened, y.float())


def _exact_abs_weight(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    return int4_gemm.dequantize(packed, out_features, dtype=torch.bfloat16).double().abs().t()


@kernels
def test_a_row_does_not_depend_on_the_other_rows(kernel):
    packed = _weight(200, 576)
    x = torch.randn(100, 576, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    whole = int4_records.matmul(x, packed, 200, native=True, kernel=kernel)
    for start, stop in ((0, 1), (17, 50), (93, 100)):
        assert torch.equal(int4_records.matmul(x[start:stop], packed, 200, native=True, kernel=kernel),
                           whole[start:stop])
    strided = torch.zeros(100, 640, dtype=torch.bfloat16)
    strided[:, :576] = x  # rows at a stride wider than the row: read in place
    assert torch.equal(int4_records.matmul(strided[:, :576], packed, 200, native=True, kernel=kernel), whole)


@kernels
def test_threads_split_the_work_without_changing_a_bit(kernel):
    packed = _weight(960, 576)
    x = torch.randn(70, 576, generator=torch.Generator().manual_seed(2))
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = int4_records.matmul(x, packed, 960, native=True, kernel=kernel)
        torch.set_num_threads(2)
        two = int4_records.matmul(x, packed, 960, native=True, kernel=kernel)
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(one, two)


@needs_one
def test_dequantized_matmul_takes_the_records_below_their_bound_only():
    packed = _weight(96, 576)
    x = torch.randn(40, 576, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    records = int4_records.matmul(x, packed, 96, native=True)
    onednn = int4_gemm.dequantized_matmul(x, packed, 96, torch.bfloat16, native=True)
    assert torch.equal(int4_gemm.dequantized_matmul(x, packed, 96, torch.bfloat16, True, records_below=41), records)
    assert torch.equal(int4_gemm.dequantized_matmul(x, packed, 96, torch.bfloat16, True, records_below=40), onednn)
    # float32 GEMMs never take the bf16 record-fed kernels
    f32 = int4_gemm.dequantized_matmul(x.float(), packed, 96, torch.float32, records_below=NEVER)
    assert torch.equal(f32, int4_gemm.dequantized_matmul(x.float(), packed, 96, torch.float32))


def test_bad_shapes_are_refused_naming_them():
    packed = _weight(32, 64)
    with pytest.raises(ValueError, match="width 96"):
        int4_records.matmul(torch.randn(4, 96), packed, 32)


@needs_one
def test_the_choice_measures_a_bound_where_a_record_fed_kernel_runs():
    choice = int4_choice.measured_choice("vnni" if int4_matmul.available() else "avx2", ("float32", "bfloat16"),
                                         "test")
    if choice.gemm_dtype == "bfloat16":
        assert choice.records_below in (0, *int4_choice.RECORD_BOUNDS[1:])
    else:
        assert choice.records_below == 0


@pytest.mark.skipif(not int4_choice.int4_avx2.available(), reason="the int4 kernels are not built here")
def test_no_bound_where_no_record_fed_kernel_runs(monkeypatch):
    monkeypatch.setattr(int4_records, "available", lambda: False)
    backend = "vnni" if int4_matmul.available() else "avx2"
    dtypes = int4_choice.gemm_dtypes(int4_choice.cpu_features())  # bf16 only where this CPU has it (else very slow)
    assert int4_choice._measured(backend, dtypes, "test").records_below == 0


@pytest.mark.parametrize("faster_below,bound", [(1024, 1024), (2048, 2048), (NEVER, 2049), (0, 0), (256, 256)])
def test_the_bound_is_where_the_summed_time_is_least(monkeypatch, faster_below, bound):
    """Timings stand in for the probe: the record-fed kernel takes half oneDNN's time below `faster_below`
    rows and twice it from there. Faster at every probe, it still stops past the largest: nothing beyond it was
    measured."""
    counts = iter(int4_choice.RECORD_PROBE_ROWS)

    def timed(calls, rounds=3):  # seconds of one pass over the probe's weights
        rows = next(counts) * int4_choice.COLD_WEIGHTS
        return [rows * (0.5 if rows < faster_below * int4_choice.COLD_WEIGHTS else 2.0), rows * 1.0]

    monkeypatch.setattr(int4_choice, "_best_seconds", timed)
    found, per_row = int4_choice._records_below()
    assert found == bound
    assert per_row == {rows: (0.5 if rows < faster_below else 2.0) if rows < bound else 1.0
                       for rows in int4_choice.RECORD_PROBE_ROWS}
