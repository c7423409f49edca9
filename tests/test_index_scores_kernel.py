"""The indexer's score kernel (cpllm/kernels/index_scores.c) against the torch form (cpllm/layers/sparse_mla/
indexer.py `index_scores` on a gathered copy of the keys, then the causal mask): every pool dtype, head counts on and
off a multiple of 16 and over 64 (several passes), keys in any slot order, rows that see none, some or all keys; a
key's score the same bits wherever it falls in the call (what keeps the ranks' candidates the one-rank scores); the
fallback (CPLLM_KERNELS=0) gives the torch form; a slot outside the pool raises, naming it."""

from __future__ import annotations

import pytest
import torch

from cpllm.kernels.index_scores import index_scores as kernel_scores
from cpllm.kernels.library import load
from cpllm.layers.sparse_mla.indexer import index_scores, masked_index_scores

NEG_INF = float("-inf")


def problem(rows: int, heads: int, width: int, keys: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(keys + 37, 1, width, generator=gen).to(dtype)
    slots = torch.randperm(keys + 37, generator=gen)[:keys]
    key_pos = torch.arange(keys) * 2  # a rank's positions: ascending, with gaps
    query_pos = torch.randint(-1, 2 * keys + 1, (rows,), generator=gen)
    q = torch.randn(rows, heads, width, generator=gen)
    w = torch.randn(rows, heads, generator=gen)
    return q, w, pool, slots, key_pos, query_pos


def reference(q, w, pool, slots, key_pos, query_pos, scale):
    scores = index_scores(q, w, pool[slots, 0].float(), scale)
    return scores.masked_fill(key_pos.unsqueeze(0) > query_pos.unsqueeze(1), NEG_INF)


def kernel_built() -> bool:
    q, w, pool, slots, key_pos, query_pos = problem(1, 16, 16, 4, torch.float32)
    return load("index_scores") is not None and kernel_scores(q, w, pool, slots, key_pos, query_pos, 1.0) is not None


needs_kernel = pytest.mark.skipif(not kernel_built(), reason="index_scores kernel not built here (no AVX-512)")


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,heads,width,keys", [(1, 16, 32, 301), (5, 32, 128, 1030), (3, 64, 128, 17),
                                                   (4, 80, 64, 260), (2, 3, 8, 9)])
def test_kernel_matches_the_torch_form(dtype, rows, heads, width, keys):
    q, w, pool, slots, key_pos, query_pos = problem(rows, heads, width, keys, dtype, seed=heads + keys)
    scale = width**-0.5
    got = kernel_scores(q, w, pool, slots, key_pos, query_pos, scale)
    want = reference(q, w, pool, slots, key_pos, query_pos, scale)
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    seen = ~torch.isneginf(want)
    torch.testing.assert_close(got[seen], want[seen], rtol=1e-5, atol=1e-5)


@needs_kernel
def test_a_keys_score_does_not_depend_on_where_it_falls():
    q, w, pool, slots, key_pos, query_pos = problem(2, 64, 128, 700, torch.bfloat16, seed=3)
    query_pos = torch.tensor([10**6, 10**6])
    full = kernel_scores(q, w, pool, slots, key_pos, query_pos, 0.1)
    order = torch.randperm(700, generator=torch.Generator().manual_seed(1))
    part = kernel_scores(q, w, pool, slots[order[:333]], key_pos[order[:333]], query_pos, 0.1)
    assert torch.equal(part, full[:, order[:333]])


def test_fallback_is_the_torch_form(monkeypatch):
    q, w, pool, slots, key_pos, query_pos = problem(3, 16, 32, 50, torch.bfloat16, seed=5)
    monkeypatch.setenv("CPLLM_KERNELS", "0")
    assert kernel_scores(q, w, pool, slots, key_pos, query_pos, 0.5) is None
    got = masked_index_scores(q, w, pool, slots, key_pos, query_pos, 0.5)
    assert torch.equal(got, reference(q, w, pool, slots, key_pos, query_pos, 0.5))


@needs_kernel
def test_a_slot_outside_the_pool_raises():
    q, w, pool, slots, key_pos, query_pos = problem(1, 16, 32, 8, torch.float32)
    slots = slots.clone()
    slots[5] = pool.shape[0] + 3
    with pytest.raises(IndexError, match=f"slot {pool.shape[0] + 3} out of range"):
        kernel_scores(q, w, pool, slots, key_pos, query_pos, 1.0)
