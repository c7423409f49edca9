"""The per-row C kernels of eager decode steps against the torch ops they replace.

Rotary embedding (cpllm/kernels/decode_rows.c) must give torch's bits, on views into the fused q|k|v row as
the attention layer passes them; the K/V store must write what index_copy_ writes, for every pool dtype; the
RMSNorm (cpllm/kernels/rms_norm.c) may differ from torch's only by the order of its sum of squares, and
silu(gate) * up only by its own exp (within 1e-6). The fused layers' float32 matmul (cpllm/kernels/f32_matmul.c)
matches float64 within float32 rounding for 1 to 17 rows, each row's bits its own alone. Where a
kernel does not apply (another dtype, a layout it does not read) the helper says so and changes nothing.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cpllm.kernels import library
from cpllm.kernels.decode_rows import rope_qk_, silu_mul, store_rows_, widen_rope_qkv
from cpllm.kernels.rms_norm import add_residual, add_rms_norm, rms_norm
from cpllm.model.rope import apply_rope

pytestmark = pytest.mark.skipif(library.load("decode_rows") is None, reason="no C compiler on this machine")

N, HQ, HKV, D = 5, 9, 3, 64


def _qkv(seed: int = 0):
    """q, k, v as views into one fused row per token, and rotary tables for random positions."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(N, (HQ + 2 * HKV) * D, generator=gen)
    q, k, v = qkv.split([HQ * D, HKV * D, HKV * D], dim=-1)
    angles = torch.rand(N, 1, D // 2, generator=gen) * 100
    tables = (torch.cat([angles.cos()] * 2, -1), torch.cat([-angles.sin(), angles.sin()], -1))
    return q.view(N, HQ, D), k.view(N, HKV, D), v.reshape(N, HKV, D), tables


def test_rope_gives_torchs_bits_in_place():
    q, k, _, tables = _qkv()
    want_q, want_k = apply_rope(tables, q), apply_rope(tables, k)
    assert rope_qk_(tables, q, k)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)


def test_rope_declines_what_it_does_not_read():
    q, k, _, tables = _qkv()
    before = q.clone()
    assert not rope_qk_(tables, q.to(torch.bfloat16), k.to(torch.bfloat16))
    assert not rope_qk_(tables, q.transpose(0, 1), k.transpose(0, 1))
    assert torch.equal(q, before)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("head_dim", [D, 24])
def test_widened_rope_gives_the_widening_copy_and_rope_bits(threads, head_dim, monkeypatch):
    """A bf16 GEMM's q|k|v rows widened and rotated in one pass: bit for bit the float32 copy then rope_qk_ (v
    widened only), on enough rows to run threaded; a head size that is a multiple of 32 (AVX-512's registers) and
    one that is not (the scalar way)."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    gen = torch.Generator().manual_seed(3)
    rows, D = 300, head_dim
    qkv = torch.randn(rows, (HQ + 2 * HKV) * D, generator=gen).to(torch.bfloat16)
    angles = torch.rand(rows, 1, D // 2, generator=gen) * 100
    tables = (torch.cat([angles.cos()] * 2, -1).contiguous(),
              torch.cat([-angles.sin(), angles.sin()], -1).contiguous())
    want = qkv.float()
    q, k, _ = want.split([HQ * D, HKV * D, HKV * D], dim=-1)
    assert rope_qk_(tables, q.view(rows, HQ, D), k.view(rows, HKV, D))
    assert torch.equal(widen_rope_qkv(tables, qkv, HQ, HKV, D), want)
    assert widen_rope_qkv(tables, qkv.float(), HQ, HKV, D) is None  # float32 rows: rope_qk_'s job
    with pytest.raises(ValueError, match="do not fit together"):
        widen_rope_qkv(tables, qkv[:, :-D].contiguous(), HQ, HKV, D)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_store_writes_what_index_copy_writes(dtype):
    _, _, v, _ = _qkv(seed=1)
    v[2, 0, :5] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e-40, 3.0000002])  # rounding's edges
    pool, want = torch.zeros(40, HKV, D, dtype=dtype), torch.zeros(40, HKV, D, dtype=dtype)
    slots, rows = torch.tensor([3, 39, 17]), torch.tensor([4, 0, 2])
    assert store_rows_(pool, slots, v, rows)
    want.index_copy_(0, slots, v.index_select(0, rows).to(dtype))
    torch.testing.assert_close(pool, want, rtol=0, atol=0, equal_nan=True)  # NaN's payload aside, the same bits


def test_store_declines_a_pool_of_another_shape():
    _, _, v, _ = _qkv()
    pool = torch.zeros(40, HKV + 1, D)
    assert not store_rows_(pool, torch.tensor([1]), v, torch.tensor([0]))
    assert not pool.any()


@pytest.mark.parametrize("shape", [(1, 576), (7, 64), (300, 4096), (2, 3, 100)])
def test_rms_norm_matches_torch(shape):
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(*shape, generator=gen), torch.randn(shape[-1], generator=gen)
    got, want = rms_norm(x, w, 1e-5), F.rms_norm(x, (shape[-1],), w, 1e-5)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_rms_norm_of_heads_inside_fused_rows():
    """Per-head q/k norms (Qwen3) read the heads in place inside the fused q|k|v rows, and return them packed."""
    gen = torch.Generator().manual_seed(3)
    qkv, w = torch.randn(9, 6 * 64 + 2 * 2 * 64, generator=gen), torch.randn(64, generator=gen)
    q = qkv[:, : 6 * 64].view(9, 6, 64)  # rows 640 floats apart
    got = rms_norm(q, w, 1e-6)
    assert got.is_contiguous()
    torch.testing.assert_close(got, F.rms_norm(q.contiguous(), (64,), w, 1e-6), rtol=1e-6, atol=1e-6)
    assert rms_norm(qkv[:, ::2], torch.randn(qkv.shape[1] // 2), 1e-6) is None  # columns apart: torch's path


def test_rms_norm_leaves_other_dtypes_to_torch():
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    assert rms_norm(x, torch.ones(64, dtype=torch.bfloat16), 1e-5) is None


@pytest.mark.parametrize("rows", [1, 300])
@pytest.mark.parametrize("delta_dtype", [None, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [576, 100])
def test_add_rms_norm_gives_the_bits_of_add_norm_and_cast(rows, delta_dtype, width):
    """The residual add and the next norm in one pass: the sum is torch's add (a bf16 delta widened), the norm the
    unfused kernel's on that sum, in float32 or rounded to bf16 as torch rounds; 300 rows take the threaded path,
    width 100 the 16-lane body and its scalar tail, and a row scaled to 1e-38 puts subnormals through the rounding."""
    gen = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, width, generator=gen), torch.randn(width, generator=gen)
    w[::7] *= 1e-38  # norms of about 1: these lanes' products are subnormal before the bf16 rounding
    delta = None if delta_dtype is None else torch.randn(rows, width, generator=gen).to(delta_dtype)
    total_want = x if delta is None else x + delta.float()
    for out_dtype in (torch.float32, torch.bfloat16):
        total, normed = add_rms_norm(x, delta, w, 1e-5, out_dtype)
        assert torch.equal(total, total_want) and normed.dtype == out_dtype
        assert torch.equal(normed, rms_norm(total_want, w, 1e-5).to(out_dtype))
    assert add_rms_norm(x, delta, w, 1e-5, torch.float16) is None  # another output dtype: the caller's torch path
    with pytest.raises(ValueError, match=f"width {width}"):
        add_rms_norm(x, delta, w[:64], 1e-5, torch.float32)


def test_add_residual_widens_a_bf16_delta_as_torch_does():
    gen = torch.Generator().manual_seed(4)
    x, delta = torch.randn(300, 576, generator=gen), torch.randn(300, 576, generator=gen).to(torch.bfloat16)
    assert torch.equal(add_residual(x, delta), x + delta.float())
    assert torch.equal(add_residual(x, delta.float()), x + delta.float())


@pytest.mark.parametrize("rows", [1, 3, 300])
def test_silu_mul_matches_torch(rows):
    """The vector body (16 lanes), the scalar tail (inter 100 is 6 x 16 + 4) and the multi-threaded row split."""
    gen = torch.Generator().manual_seed(rows)
    gate_up = torch.randn(rows, 200, generator=gen) * 6
    gate, up = gate_up.split(100, dim=-1)
    torch.testing.assert_close(silu_mul(gate_up, 100), F.silu(gate) * up, rtol=1e-6, atol=1e-7)
    assert silu_mul(gate_up.to(torch.float16), 100) is None


@pytest.mark.parametrize("rows", [1, 300])
def test_silu_mul_on_bf16_rows_gives_the_float32_kernels_bits(rows):
    """bf16 gate | up (a bf16 GEMM's output): in float32 the float32 kernel's bits on the widened rows, in bf16
    those rounded as torch rounds (to nearest even, NaN and subnormals kept), through the vector body and the scalar tail."""
    gen = torch.Generator().manual_seed(rows)
    gate_up = (torch.randn(rows, 200, generator=gen) * 6).to(torch.bfloat16)
    gate_up[0, 3], gate_up[0, 150] = float("nan"), float("inf")
    gate_up[0, 5], gate_up[0, 105] = 1e-38, 1.0  # a subnormal product: the hardware's bf16 rounding flushes it
    wide = silu_mul(gate_up.float(), 100)
    torch.testing.assert_close(silu_mul(gate_up, 100, torch.float32), wide, rtol=0, atol=0, equal_nan=True)
    assert silu_mul(gate_up, 100) is None  # a bf16 model's own rows, not asked for: its torch ops round as it does
    narrow = silu_mul(gate_up, 100, torch.bfloat16)
    bits = lambda t: t.view(torch.int16)  # noqa: E731
    number = ~wide.isnan()
    assert narrow.dtype == torch.bfloat16 and wide.isnan().any()
    assert torch.equal(bits(narrow)[number], bits(wide.to(torch.bfloat16))[number]) and narrow[~number].isnan().all()
    assert silu_mul(gate_up.float(), 100, torch.bfloat16) is None  # float32 rows are not rounded here


def _f32_matmul(lib, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, c0: int, c1: int, threads: int) -> None:
    rows, k = x.shape
    assert lib.cpllm_f32_matmul_cols(x.data_ptr(), rows, k, w.data_ptr(), w.shape[1], c0, c1, y.data_ptr(),
                                     y.shape[1], threads) == 0


@pytest.mark.parametrize("rows", [1, 2, 5, 9, 16, 17])  # blocks of 16 rows; a verify step's 5, 9, 17
def test_f32_matmul_rows_match_float64_and_each_row_alone(rows):
    """Columns 16 .. N - 3 of a range (a decode team's share, a tail of 13 lanes), inputs not a multiple of the
    64-input blocks, two threads: within float32 rounding of float64, columns outside untouched, and each row's
    result bit for bit the row's alone."""
    lib = library.load("decode_layer")
    if lib is None or lib.cpllm_f32_available() != 1:
        pytest.skip("no AVX-512 for the float32 matmul")
    gen = torch.Generator().manual_seed(rows)
    k, n = 200, 1000
    x, w = torch.randn(rows, k, generator=gen), torch.randn(k, n, generator=gen)
    y = torch.full((rows, n), float("nan"))
    _f32_matmul(lib, x, w, y, 16, n - 3, 2)
    want = x.double() @ w.double()
    assert (y[:, 16 : n - 3].double() - want[:, 16 : n - 3]).abs().max().item() < 1e-4
    assert y[:, :16].isnan().all() and y[:, n - 3 :].isnan().all()
    for r in range(rows):
        alone = torch.full((1, n), float("nan"))
        _f32_matmul(lib, x[r : r + 1].contiguous(), w, alone, 16, n - 3, 1)
        assert torch.equal(alone[0, 16 : n - 3], y[r, 16 : n - 3])
