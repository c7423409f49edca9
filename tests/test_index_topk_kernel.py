"""The indexer's top-k kernel (cpllm/kernels/index_topk.c) against the torch form (cpllm/layers/sparse_mla/topk.py
`torch_top_k`): the same scores (bit for bit) and positions in the same order on random and tie-heavy rows, -inf
(masked) keys, -0 and NaN, k above, equal to and below the row's keys, positions shared or per row, int64 or
int32, in any order and repeated (the -1 padding of candidate lists); `top_k` runs the torch form when kernels are
off (CPLLM_KERNELS=0), and positions the kernel's key cannot hold."""

from __future__ import annotations

import pytest
import torch

from cpllm.kernels.index_topk import index_top_k
from cpllm.kernels.library import load
from cpllm.layers.sparse_mla.topk import top_k, torch_top_k

NEG_INF = float("-inf")

needs_kernel = pytest.mark.skipif(load("index_topk") is None, reason="index_topk kernel not built here")


def assert_same(got, want):
    assert got[0].shape == want[0].shape and got[1].dtype == want[1].dtype
    assert torch.equal(got[0].view(torch.int32), want[0].view(torch.int32))  # the bits, -0 and NaN included
    assert torch.equal(got[1], want[1])


def compare(scores, positions, k):
    positions = positions if positions.dim() == 2 else positions.unsqueeze(0).expand(scores.shape[0], -1)
    got = index_top_k(scores, positions, k)
    assert got is not None
    assert_same(got, torch_top_k(scores, positions, k))


@needs_kernel
@pytest.mark.parametrize("width", [1, 7, 300, 5000])
@pytest.mark.parametrize("k_of", ["one", "half", "all", "more"])
def test_random_and_tie_heavy_rows(width, k_of):
    k = {"one": 1, "half": max(1, width // 2), "all": width, "more": width + 9}[k_of]
    gen = torch.Generator().manual_seed(width)
    compare(torch.randn(3, width, generator=gen), torch.arange(width) * 3, k)  # distinct scores
    ties = torch.randint(0, 4, (3, width), generator=gen).float()  # four values: ties everywhere
    ties[torch.rand(3, width, generator=gen) < 0.3] = NEG_INF  # keys the rows may not see
    compare(ties, torch.randperm(width, generator=gen), k)  # positions in no order
    compare(ties, torch.randint(-1, 20, (3, width), generator=gen, dtype=torch.int32), k)  # repeated, per row


@needs_kernel
def test_masked_rows_signed_zeros_and_nan():
    gen = torch.Generator().manual_seed(1)
    scores = torch.randint(-1, 2, (4, 600), generator=gen).float()
    scores[0] = NEG_INF  # a row that sees no key
    scores[1, :550] = NEG_INF  # fewer than k visible
    scores[2, ::3] = -0.0  # ties with +0
    scores[3, ::7] = float("nan")
    positions = torch.randperm(600, generator=gen)
    for k in (64, 599, 600):
        compare(scores, positions, k)


@needs_kernel
def test_decode_and_prefill_shapes():
    """One row of a 16K context and a few hundred prefill rows with a causal mask, k = 2048, as the layer calls."""
    gen = torch.Generator().manual_seed(2)
    compare(torch.randn(1, 16384, generator=gen), torch.arange(16384), 2048)
    rows, width = 200, 2600
    scores = torch.randn(rows, width, generator=gen)
    query_pos = torch.arange(width - rows, width)
    scores.masked_fill_(torch.arange(width)[None] > query_pos[:, None], NEG_INF)
    compare(scores, torch.arange(width), 2048)


@needs_kernel
def test_candidate_union_as_the_layer_builds_it():
    """Candidate lists padded with -inf at position -1 (int32), merged: the kernel and the torch form agree."""
    gen = torch.Generator().manual_seed(3)
    k, ranks = 32, 4
    scores = torch.randint(0, 3, (5, ranks * k), generator=gen).float()
    positions = torch.randperm(ranks * k * 2, generator=gen)[:ranks * k].int().repeat(5, 1)
    scores[:, k - 5:k] = NEG_INF
    positions[:, k - 5:k] = -1
    compare(scores, positions, k)


def test_fallback_is_the_torch_form(monkeypatch):
    gen = torch.Generator().manual_seed(4)
    scores = torch.randint(0, 3, (3, 100), generator=gen).float()
    positions = torch.randperm(100, generator=gen)
    want = torch_top_k(scores, positions.expand(3, -1), 10)
    monkeypatch.setenv("CPLLM_KERNELS", "0")
    assert index_top_k(scores, positions.expand(3, -1), 10) is None
    assert_same(top_k(scores, positions, 10), want)
    monkeypatch.delenv("CPLLM_KERNELS")
    assert_same(top_k(scores, positions, 10), want)
    far = positions + 2 ** 40  # beyond the kernel's 32-bit position key: the torch form answers
    assert index_top_k(scores, far.expand(3, -1), 10) is None
    assert_same(top_k(scores, far, 10), torch_top_k(scores, far.expand(3, -1), 10))
