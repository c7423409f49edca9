"""The int4 matmul kernel (cpllm/kernels/int4_matmul.c) against what it is specified to compute, and its fallback.

The kernel quantizes each activation row per group of 32 to two int8 codes (xq with step s = max|x| / 127, then
the remainder with step s / 254) and multiplies them by the 4-bit codes in integers, with each group's d and m
in float16. `_simulated` computes exactly that in float64, so the kernel must equal it up to float32 rounding of
its per-group sums. Also: a row's result is the same whatever else is in the batch (every tile and chunk size,
1 and 2 threads), output rows that do not fill a block of 16, an empty batch, the compiled graph's custom op,
and the aten fallback when kernels are off.
"""

from __future__ import annotations

import pytest
import torch

from cpllm.kernels import int4_matmul
from cpllm.model.formats.groups import Int4Groups, quantize_int4
from cpllm.model.formats.group_kernels import Int4Linear

pytestmark = pytest.mark.skipif(not int4_matmul.available(), reason="no AVX-512 VNNI kernel on this machine")


def _groups(rows: int, cols: int, seed: int = 0) -> Int4Groups:
    return quantize_int4(torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.05)


def _simulated(x: torch.Tensor, groups: Int4Groups) -> torch.Tensor:
    """float64 [M, N]: the kernel's arithmetic, exactly."""
    xg = x.double().view(x.shape[0], -1, 32)  # [M, G, 32]
    step = (xg.abs().amax(-1, keepdim=True) / 127).float().double()
    safe = torch.where(step > 0, step, torch.ones_like(step))
    xq = torch.round(xg / safe)
    xr = torch.round((xg - xq * step) / (safe / 254))
    codes = groups.codes.double().view(groups.shape[0], -1, 32)  # [N, G, 32]
    d, m = (t.to(torch.float16).double() for t in (groups.d, groups.m))  # [N, G]
    dots = torch.einsum("mgk,ngk->mng", 254 * xq + xr, codes)
    return (dots * d[None] * (step[..., 0] / 254)[:, None]).sum(-1) + xg.sum(-1) @ m.t()


@pytest.mark.parametrize("rows,cols,batch", [(64, 64, 1), (100, 576, 3), (1536, 576, 7), (49, 1152, 130),
                                             (3072, 576, 9), (960, 576, 17)])  # the last two: verify steps' rows
def test_kernel_computes_its_specification(rows, cols, batch):
    groups = _groups(rows, cols)
    x = torch.randn(batch, cols, generator=torch.Generator().manual_seed(1))
    x[0, :32] = 0.0  # an all-zero group: step 0
    y = int4_matmul.matmul(x, int4_matmul.pack(groups.codes, groups.d, groups.m), rows)
    want = _simulated(x, groups)
    assert y.shape == (batch, rows) and y.dtype == torch.float32
    assert float((y.double() - want).abs().max() / want.abs().max()) < 1e-5
    exact = x.double() @ groups.dequantize().double().t()
    assert float((y.double() - exact).norm() / exact.norm()) < 1e-3  # the float16 m of quantize_int4 dominates


@pytest.mark.parametrize("threads", [1, 2])
def test_a_row_gives_the_same_bits_in_any_batch(threads):
    """Tiles of 4 rows, chunks of 64: row 70's result alone, in a batch of 130, and with 2 threads."""
    groups = _groups(200, 576, seed=2)
    packed = int4_matmul.pack(groups.codes, groups.d, groups.m)
    x = torch.randn(130, 576, generator=torch.Generator().manual_seed(3))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = int4_matmul.matmul(x[70:71], packed, 200)
        few = int4_matmul.matmul(x[68:73], packed, 200)
        many = int4_matmul.matmul(x, packed, 200)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(alone[0], many[70]) and torch.equal(few[2], many[70])


def test_an_empty_batch_gives_an_empty_result():
    groups = _groups(32, 64)
    y = int4_matmul.matmul(torch.empty(0, 64), int4_matmul.pack(groups.codes, groups.d, groups.m), 32)
    assert y.shape == (0, 32)


def test_compiled_graph_calls_the_same_kernel():
    groups = _groups(48, 128, seed=5)
    layer = Int4Linear(groups)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(6))
    compiled = torch.compile(layer, fullgraph=True)  # fullgraph: the custom op must not break the graph
    assert torch.equal(compiled(x), layer(x))


def test_kernels_off_runs_aten_with_its_bfloat16_precision(monkeypatch):
    groups = _groups(48, 128, seed=7)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(8))
    exact = x.double() @ groups.dequantize().double().t()
    fast = Int4Linear(groups)
    fast_y = fast(x)
    monkeypatch.setenv("CPLLM_KERNELS", "0")  # read at each call: the next layer packs for aten
    fallback = Int4Linear(groups)
    assert (fast.backend, fallback.backend) == ("vnni", "aten")
    errors = [float((y.double() - exact).norm() / exact.norm()) for y in (fast_y, fallback(x))]
    assert errors[0] < 1e-3 and 1e-3 < errors[1] < 1e-2
