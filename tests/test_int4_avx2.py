"""The AVX2 int4 kernel (cpllm/kernels/int4_avx2.c) against its specification, and the choice of kernel by CPU.

The integer kernel computes what the VNNI kernel is specified to compute (`_simulated` of test_int4_kernel.py: int8
activations in two codes per group, integer dot products, float16 d and m), so it must equal that up to float32
rounding; the prefill way dequantizes the weight (exactly d q + m in float32) for float32 GEMMs, so it must equal
x W^T on the dequantized weight to float32 rounding; in bfloat16 (int4_gemm.py), the dequantized weight is the stored one
rounded once, and the GEMM that of torch on the rounded operands. The choice (int4_choice.py) is tested with the CPU's
reported features replaced: each missing feature must lead to the fallback.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_int4_kernel import _groups, _simulated

from cpllm.kernels import int4_avx2, int4_choice, int4_gemm, int4_matmul
from cpllm.model.formats.group_kernels import Int4Linear

needs_avx2 = pytest.mark.skipif(not int4_avx2.available(), reason="no AVX2 + FMA + F16C kernel on this machine")
ALL = int4_choice.CpuFeatures(avx2=True, fma=True, f16c=True, avx512_vnni=True, avx512_bf16=True, amx=True)


def _stored(groups) -> torch.Tensor:
    """float32 [rows, cols]: the weight as the packed layout holds it (d and m rounded to float16)."""
    d, m = (t.to(torch.float16).float().repeat_interleave(32, dim=1) for t in (groups.d, groups.m))
    return d * groups.codes.float() + m


@needs_avx2
@pytest.mark.parametrize("rows,cols,batch", [(64, 64, 1), (100, 576, 3), (1536, 576, 7), (49, 1152, 130),
                                             (3072, 576, 9), (960, 576, 17)])
def test_integer_kernel_computes_the_vnni_specification(rows, cols, batch):
    groups = _groups(rows, cols)
    x = torch.randn(batch, cols, generator=torch.Generator().manual_seed(1))
    x[0, :32] = 0.0  # an all-zero group: step 0
    y = int4_avx2.matmul(x, int4_matmul.pack(groups.codes, groups.d, groups.m), rows)
    want = _simulated(x, groups)
    assert y.shape == (batch, rows) and y.dtype == torch.float32
    assert float((y.double() - want).abs().max() / want.abs().max()) < 1e-5


@needs_avx2
@pytest.mark.parametrize("rows,cols", [(48, 32), (100, 576), (40, 1152)])
def test_dequantize_gives_the_stored_weight_exactly(rows, cols):
    groups = _groups(rows, cols, seed=4)
    packed = int4_matmul.pack(groups.codes, groups.d, groups.m)
    assert torch.equal(int4_gemm.dequantize(packed, rows), _stored(groups))
    # a range of blocks: rows [16, 48) (up to the last row where fewer)
    assert torch.equal(int4_gemm.dequantize(packed, rows, 1, 3), _stored(groups)[16:48])
    # bfloat16: the stored weight rounded once to nearest even, as torch rounds it, 16 rows at once (AVX-512 BF16)
    # and row by row (AVX2, the fallback), whole and as a range of blocks
    for row_by_row in (False, True):
        bf16 = int4_gemm.dequantize(packed, rows, dtype=torch.bfloat16, row_by_row=row_by_row)
        assert torch.equal(bf16, _stored(groups).bfloat16())
        part = int4_gemm.dequantize(packed, rows, 1, 3, dtype=torch.bfloat16, row_by_row=row_by_row)
        assert torch.equal(part, _stored(groups)[16:48].bfloat16())


@needs_avx2
@pytest.mark.parametrize("scratch", [int4_gemm.SCRATCH_BYTES, 16 * 576 * 4 * 3])  # one tile; tiles of 48 rows
def test_dequantized_matmul_is_the_float32_gemm_on_the_stored_weight(monkeypatch, scratch):
    monkeypatch.setattr(int4_gemm, "SCRATCH_BYTES", scratch)
    groups = _groups(200, 576, seed=5)
    x = torch.randn(70, 576, generator=torch.Generator().manual_seed(6))
    y = int4_gemm.dequantized_matmul(x, int4_matmul.pack(groups.codes, groups.d, groups.m), 200)
    want = x.double() @ _stored(groups).double().t()
    assert y.shape == (70, 200) and float((y.double() - want).abs().max() / want.abs().max()) < 1e-5


@needs_avx2
@pytest.mark.parametrize("scratch", [int4_gemm.SCRATCH_BYTES, 16 * 576 * 2 * 3])
def test_bfloat16_gemm_is_torchs_on_the_rounded_operands(monkeypatch, scratch):
    monkeypatch.setattr(int4_gemm, "SCRATCH_BYTES", scratch)
    groups = _groups(200, 576, seed=5)
    x = torch.randn(70, 576, generator=torch.Generator().manual_seed(6))
    y = int4_gemm.dequantized_matmul(x, int4_matmul.pack(groups.codes, groups.d, groups.m), 200, torch.bfloat16)
    rounded = x.bfloat16().double() @ _stored(groups).bfloat16().double().t()  # float32 sums of bf16 products
    exact = x.double() @ _stored(groups).double().t()
    assert y.dtype == torch.float32 and y.shape == (70, 200)
    # the output is rounded to bfloat16 once (2^-8 relative at most); the operands' rounding adds its own
    assert float(((y.double() - rounded).abs() / rounded.abs().clamp_min(1e-3 * rounded.abs().max())).max()) < 2 ** -8
    assert float((y.double() - exact).abs().max() / exact.abs().max()) < 2e-2


@needs_avx2
@pytest.mark.parametrize("threads", [1, 2])
def test_a_row_gives_the_same_bits_in_any_batch(threads):
    groups = _groups(200, 576, seed=2)
    packed = int4_matmul.pack(groups.codes, groups.d, groups.m)
    x = torch.randn(130, 576, generator=torch.Generator().manual_seed(3))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone, few, many = (int4_avx2.matmul(rows, packed, 200) for rows in (x[70:71], x[68:73], x))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(alone[0], many[70]) and torch.equal(few[2], many[70])


@needs_avx2
def test_bad_shapes_raise_naming_the_limits():
    groups = _groups(48, 128)
    packed = int4_matmul.pack(groups.codes, groups.d, groups.m)
    with pytest.raises(ValueError, match="width 96"):
        int4_avx2.matmul(torch.randn(2, 96), packed, 48)
    with pytest.raises(ValueError, match="64 outputs"):
        int4_gemm.dequantized_matmul(torch.randn(2, 128), packed, 64)
    with pytest.raises(ValueError, match="blocks \\[2, 4\\)"):
        int4_gemm.dequantize(packed, 48, 2, 4)
    with pytest.raises(ValueError, match="float32 or bfloat16 only"):
        int4_gemm.dequantize(packed, 48, dtype=torch.float16)
    assert int4_avx2.matmul(torch.empty(0, 128), packed, 48).shape == (0, 48)


@needs_avx2
@pytest.mark.parametrize("gemm_dtype", ["float32", "bfloat16"])
def test_layer_switches_to_the_gemms_at_its_threshold_and_keeps_running_with_kernels_off(monkeypatch, gemm_dtype):
    groups = _groups(96, 576, seed=7)
    layer = Int4Linear(groups, backend="avx2")
    layer.gemm_from_rows, layer.gemm_dtype = 8, gemm_dtype
    few, many = (torch.randn(n, 576, generator=torch.Generator().manual_seed(n)) for n in (7, 8))
    assert torch.equal(layer(few), int4_avx2.matmul(few, layer.packed, 96))
    assert torch.equal(layer(many), int4_gemm.dequantized_matmul(many, layer.packed, 96,
                                                                 int4_gemm.GEMM_DTYPES[gemm_dtype]))
    monkeypatch.setenv("CPLLM_KERNELS", "0")  # the packed layout has no other kernel: the layer keeps its own
    assert torch.equal(layer(few), int4_avx2.matmul(few, layer.packed, 96))


@needs_avx2
def test_native_output_is_the_gemms_own_dtype_with_the_same_values():
    """`native` keeps a bf16 GEMM's output as it is (the float32 result is its exact widening); below the threshold,
    or on float32 GEMMs, it is the float32 result; `input_dtype` names what each call rounds its input to."""
    layer = Int4Linear(_groups(96, 576, seed=8), backend="avx2")
    few, many = (torch.randn(n, 576, generator=torch.Generator().manual_seed(n)) for n in (7, 8))
    for gemm_dtype in ("float32", "bfloat16"):
        layer.gemm_from_rows, layer.gemm_dtype = 8, gemm_dtype
        narrow = layer(many, native=True)
        assert narrow.dtype == int4_gemm.GEMM_DTYPES[gemm_dtype] and torch.equal(narrow.float(), layer(many))
        assert layer(few, native=True).dtype == torch.float32 and torch.equal(layer(few, native=True), layer(few))
        assert layer.input_dtype(8) == int4_gemm.GEMM_DTYPES[gemm_dtype] and layer.input_dtype(7) is None


@needs_avx2
@pytest.mark.parametrize("rows", [3, 40])
def test_compiled_graph_calls_the_same_kernel(rows):
    layer = Int4Linear(_groups(48, 128, seed=5), backend="avx2")
    layer.gemm_from_rows, layer.gemm_dtype = 16, "bfloat16"
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(6))
    assert torch.equal(torch.compile(layer, fullgraph=True)(x), layer(x))


def test_flags_are_read_as_features():
    flags = {"avx2", "fma", "f16c", "avx512_vnni", "avx512bw", "amx_int8"}
    assert int4_choice.CpuFeatures.from_flags(flags) == int4_choice.CpuFeatures(
        avx2=True, fma=True, f16c=True, avx512_vnni=True, avx512_bf16=False, amx=True)
    assert not int4_choice.CpuFeatures.from_flags({"avx512_vnni"}).avx512_vnni  # VNNI's 512-bit form needs BW
    assert int4_choice.cpu_features().avx2 in (True, False)


@pytest.mark.parametrize("missing", ["avx2", "fma", "f16c"])
def test_a_missing_feature_picks_the_aten_fallback(monkeypatch, missing):
    features = int4_choice.CpuFeatures(**{**{f: getattr(ALL, f) for f in ALL.__slots__}, "avx512_vnni": False,
                                          missing: False})
    choice = int4_choice.choose(features)
    assert choice.backend == "aten" and missing in choice.reason
    monkeypatch.setattr(int4_choice, "cpu_features", lambda: features)
    assert Int4Linear(_groups(32, 64)).backend == "aten"


def test_vnni_is_taken_only_where_reported_and_built():
    no_vnni = int4_choice.CpuFeatures(avx2=True, fma=True, f16c=True, avx512_vnni=False, avx512_bf16=False, amx=False)
    assert int4_choice.choose(no_vnni).backend == ("avx2" if int4_avx2.available() else "aten")
    assert int4_choice.choose(ALL).backend == ("vnni" if int4_matmul.available() else
                                               "avx2" if int4_avx2.available() else "aten")


def test_kernels_off_picks_aten(monkeypatch):
    monkeypatch.setenv("CPLLM_KERNELS", "0")
    assert int4_choice.choose(ALL).backend == "aten"


@needs_avx2
@pytest.mark.parametrize("dtypes", [("float32",), ("float32", "bfloat16")])
def test_the_measured_choice_names_a_probed_threshold_and_a_measured_dtype(dtypes):
    choice = int4_choice.measured_choice("avx2", dtypes, "test")
    assert choice.backend == "avx2" and choice.decode_gbps > 0 and set(choice.gemm_gflops) == set(dtypes)
    assert all(rate > 0 for rate in choice.gemm_gflops.values()) and choice.gemm_dtype in dtypes
    assert choice.gemm_from_rows in (*int4_choice.PROBE_ROWS, int4_choice.NEVER)
    if choice.gemm_dtype == "bfloat16":  # short prompts and decode batches keep the integer kernel's rounding
        assert choice.gemm_from_rows >= int4_choice.BF16_MIN_ROWS


def test_bfloat16_gemms_are_measured_only_where_the_cpu_reports_them():
    plain = int4_choice.CpuFeatures(avx2=True, fma=True, f16c=True, avx512_vnni=True, avx512_bf16=False, amx=False)
    assert int4_choice.gemm_dtypes(plain) == ("float32",)
    for bf16, amx in ((True, False), (False, True)):
        features = int4_choice.CpuFeatures(avx2=True, fma=True, f16c=True, avx512_vnni=True, avx512_bf16=bf16, amx=amx)
        assert int4_choice.gemm_dtypes(features) == ("float32", "bfloat16")


def test_the_threshold_override_replaces_the_measured_row_count(monkeypatch):
    measured = int4_choice.Int4Choice(backend="avx2", gemm_from_rows=128, gemm_dtype="bfloat16", decode_gbps=1.0,
                                      gemm_gflops={"bfloat16": 900.0}, reason="test")
    assert int4_choice.with_threshold_override(measured) == measured  # unset: the measurement stands
    for value, rows in (("300", 300), (" never ", int4_choice.NEVER), ("1", 1)):
        monkeypatch.setenv(int4_choice.THRESHOLD_ENV, value)
        chosen = int4_choice.with_threshold_override(measured)
        assert chosen.gemm_from_rows == rows and chosen.gemm_dtype == "bfloat16"
        assert int4_choice.THRESHOLD_ENV in chosen.reason
    no_gemms = dataclasses.replace(measured, gemm_from_rows=int4_choice.NEVER, gemm_dtype="")
    assert int4_choice.with_threshold_override(no_gemms) == no_gemms  # nothing to switch to
    for bad in ("0", "-5", "12.5", "many"):
        monkeypatch.setenv(int4_choice.THRESHOLD_ENV, bad)
        with pytest.raises(ValueError, match=f"{int4_choice.THRESHOLD_ENV}='{bad}'"):
            int4_choice.with_threshold_override(measured)
