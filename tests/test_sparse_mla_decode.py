"""A sparse-MLA decode row's attention over its selected latent rows (cpllm/layers/sparse_mla/backend.py
`attend_selected`): the C decode kernel reading the selected rows in place from the pool, and the torch form on
the gathered selected rows (CPLLM_KERNELS=0), both against softmax attention written out over those rows alone;
rows that select only some of their K entries (another rank's keys) or none, float32 and bfloat16 pools."""

from __future__ import annotations

import pytest
import torch

from cpllm.kernels.decode_attention import built
from cpllm.layers.sparse_mla.backend import SparseMLABackend

WIDTH, R, HEADS, K = 72, 64, 8, 40


def reference(q, pool, slots, visible, scale):
    outs, lses = [], []
    for row in range(q.shape[0]):
        keys = pool[slots[row][visible[row]], 0].float()  # [k, W]
        scores = torch.einsum("hw,kw->hk", q[row].float(), keys) * scale
        lse = torch.logsumexp(scores, dim=-1) if keys.shape[0] else torch.full((HEADS,), float("-inf"))
        probs = torch.softmax(scores, dim=-1) if keys.shape[0] else torch.zeros(HEADS, 0)
        outs.append(probs @ keys[:, :R] if keys.shape[0] else torch.zeros(HEADS, R))
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


@pytest.mark.parametrize("kernels", ["1", "0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_selected_rows_attention(monkeypatch, kernels, dtype):
    if kernels == "1" and not built():
        pytest.skip("decode attention kernel not built here")
    monkeypatch.setenv("CPLLM_KERNELS", kernels)
    gen = torch.Generator().manual_seed(7)
    pool = torch.randn(500, 1, WIDTH, generator=gen).to(dtype)
    q = torch.randn(3, HEADS, WIDTH, generator=gen)
    slots = torch.stack([torch.randperm(500, generator=gen)[:K] for _ in range(3)])
    visible = torch.rand(3, K, generator=gen) < 0.6
    visible[2] = False  # a row none of whose selection this rank holds
    out, lse = SparseMLABackend.attend_selected(q, pool, slots, visible, 0.125, R)
    want_out, want_lse = reference(q, pool, slots, visible, 0.125)
    assert out.shape == (3, HEADS, R) and out.dtype == lse.dtype == torch.float32
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
