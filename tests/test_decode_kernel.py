"""The decode attention kernel (cpllm/kernels/decode_attention.c) against float64 attention, and its fallbacks.

Layout and engine tests run with the kernel wherever it builds (it is on by default); these check the kernel
alone: pool dtypes, head dims (the AVX-512 path for 64 and 128, the plain C path otherwise), grouped queries,
requests longer than one unit of work, an empty context, one and two threads, the rows of a verify chunk (one
request's consecutive positions, attending together); that the engine's entry point
gives the same numbers with the kernel on and off; and that a failed build falls back with a warning.
"""

from __future__ import annotations

import logging

import pytest
import torch

from cpllm.layers.gqa.local_attention import attend_decode
from cpllm.context_parallel.metadata import DecodeBatch
from cpllm.context_parallel.sdpa import reference_attention
from cpllm.kernels import library
from cpllm.kernels.decode_attention import paged_decode_attention

pytestmark = pytest.mark.skipif(library.load("decode_attention") is None, reason="no C compiler on this machine")


def _case(pool_dtype, head_dim: int, hq: int, hkv: int, lengths: list[int], num_slots: int = 6000, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    k_pool = torch.randn(num_slots, hkv, head_dim, generator=gen).to(pool_dtype)
    v_pool = torch.randn(num_slots, hkv, head_dim, generator=gen).to(pool_dtype)
    width = max(max(lengths), 1)
    slots = torch.zeros(len(lengths), width, dtype=torch.long)
    for b, length in enumerate(lengths):
        slots[b, :length] = torch.randperm(num_slots, generator=gen)[:length]
    q = torch.randn(len(lengths), hq, head_dim, generator=gen)
    return q, k_pool, v_pool, slots, torch.tensor(lengths)


def _reference(q, k_pool, v_pool, slots, lengths, scale):
    outs, lses = [], []
    for b, length in enumerate(lengths.tolist()):
        k = k_pool[slots[b, :length]].double().transpose(0, 1)[None]  # [1, Hkv, L, D]
        v = v_pool[slots[b, :length]].double().transpose(0, 1)[None]
        out, lse = reference_attention(q[b].double()[None, :, None], k, v, scale=scale)
        outs.append(out[0, :, 0])
        lses.append(lse[0, :, 0])
    return torch.stack(outs), torch.stack(lses)


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim,hq,hkv", [(64, 9, 3), (128, 4, 4), (32, 8, 2)])
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_matches_float64_attention(pool_dtype, head_dim, hq, hkv, threads):
    q, k_pool, v_pool, slots, lengths = _case(pool_dtype, head_dim, hq, hkv, [700, 0, 5000, 1])
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, lse = paged_decode_attention(q, k_pool, v_pool, slots, lengths, scale=head_dim**-0.5)
    finally:
        torch.set_num_threads(before)
    ref_out, ref_lse = _reference(q, k_pool, v_pool, slots, lengths, head_dim**-0.5)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert (out.double() - ref_out).abs().max().item() < 1e-5
    live = lengths > 0
    assert (lse[live].double() - ref_lse[live]).abs().max().item() < 1e-5
    assert torch.isneginf(lse[~live]).all() and (out[~live] == 0).all()  # an empty context: (0, -inf)


def _verify_rows(pool_dtype, head_dim: int, hq: int, hkv: int, rows: int, context: int, seed: int = 1):
    """`rows` rows of one request at consecutive positions (a verify chunk run as single-token rows: row i sees the
    context and rows < i), then one other request; the slot table is padded past each row's length with junk."""
    gen = torch.Generator().manual_seed(seed)
    num_slots = context + rows + 200
    k_pool = torch.randn(num_slots, hkv, head_dim, generator=gen).to(pool_dtype)
    v_pool = torch.randn(num_slots, hkv, head_dim, generator=gen).to(pool_dtype)
    order = torch.randperm(num_slots, generator=gen)
    width = context + rows
    slots = order[:width].repeat(rows + 1, 1)
    slots[rows] = order[-width:]
    lengths = torch.tensor([context + 1 + i for i in range(rows)] + [57])
    for b, length in enumerate(lengths.tolist()):
        slots[b, length:] = 10**9  # never read
    return torch.randn(rows + 1, hq, head_dim, generator=gen), k_pool, v_pool, slots.contiguous(), lengths


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,hq,hkv", [(64, 9, 3), (32, 8, 2)])  # the AVX-512 unit and the plain C one
@pytest.mark.parametrize("rows", [2, 9, 17])
@pytest.mark.parametrize("threads", [1, 2])
def test_rows_of_one_context_attend_together(pool_dtype, head_dim, hq, hkv, rows, threads):
    """Rows whose contexts are prefixes of one another's share each unit's K/V reads (from 4 rows; fewer run row by
    row): every row matches float64 attention over its own positions only, and at one thread (the same units) a
    row's bits do not depend on the group's other rows: those of a group's first 4 rows are theirs as a group of 4,
    and 2 rows are each their own alone."""
    q, k_pool, v_pool, slots, lengths = _verify_rows(pool_dtype, head_dim, hq, hkv, rows, 700)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, lse = paged_decode_attention(q, k_pool, v_pool, slots, lengths, scale=head_dim**-0.5)
        first = min(rows, 4) if rows >= 4 else 1  # a group of 4, or one row alone
        part = [paged_decode_attention(q[b:b + first], k_pool, v_pool, slots[b:b + first], lengths[b:b + first],
                                       scale=head_dim**-0.5) for b in range(0, min(rows, 4), first)]
    finally:
        torch.set_num_threads(before)
    ref_out, ref_lse = _reference(q, k_pool, v_pool, slots, lengths, head_dim**-0.5)
    assert (out.double() - ref_out).abs().max().item() < 1e-5
    assert (lse.double() - ref_lse).abs().max().item() < 1e-5
    if threads == 1:
        n = min(rows, 4)
        assert torch.equal(out[:n], torch.cat([o for o, _ in part])) and torch.equal(lse[:n], torch.cat([l for _, l in part]))


def test_kernel_keeps_the_query_dtype():
    q, k_pool, v_pool, slots, lengths = _case(torch.bfloat16, 64, 4, 2, [300, 40])
    out, _ = paged_decode_attention(q.bfloat16(), k_pool, v_pool, slots, lengths, scale=0.125)
    assert out.dtype == torch.bfloat16


def test_an_empty_batch_gives_empty_results():
    _, k_pool, v_pool, _, _ = _case(torch.float32, 64, 4, 2, [3])
    out, lse = paged_decode_attention(torch.empty(0, 4, 64), k_pool, v_pool, torch.zeros(0, 1, dtype=torch.long),
                                      torch.zeros(0, dtype=torch.long), scale=0.125)
    assert out.shape == (0, 4, 64) and lse.shape == (0, 4)


def test_engine_entry_gives_the_same_numbers_with_the_kernel_off(monkeypatch):
    q, k_pool, v_pool, slots, lengths = _case(torch.float32, 64, 6, 2, [37, 300, 5])
    valid = torch.arange(slots.shape[1]) < lengths.unsqueeze(1)
    key_mask = torch.zeros(3, 1, 1, slots.shape[1]).masked_fill(~valid[:, None, None, :], float("-inf"))
    decode = DecodeBatch(requests=(0, 1, 2), slots=slots, key_mask=key_mask, rows=torch.zeros(1, 3, dtype=torch.long),
                         max_local_context=300, lengths=lengths)
    with_kernel = attend_decode(q, k_pool, v_pool, decode, 0.125)
    monkeypatch.setenv("CPLLM_KERNELS", "0")
    assert paged_decode_attention(q, k_pool, v_pool, slots, lengths, 0.125) is None
    without = attend_decode(q, k_pool, v_pool, decode, 0.125)
    assert (with_kernel[0] - without[0]).abs().max().item() < 1e-5
    assert (with_kernel[1] - without[1]).abs().max().item() < 1e-5


def test_a_failed_build_falls_back_with_one_warning(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("CPLLM_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(library, "_loaded", {})
    q, k_pool, v_pool, slots, lengths = _case(torch.float32, 64, 2, 1, [10])
    with caplog.at_level(logging.WARNING, logger="cpllm.kernels.build"):
        assert paged_decode_attention(q, k_pool, v_pool, slots, lengths, 0.125) is None
        assert paged_decode_attention(q, k_pool, v_pool, slots, lengths, 0.125) is None
    warnings = [r for r in caplog.records if "decode_attention not built" in r.getMessage()]
    assert len(warnings) == 1 and "no-such-compiler" in warnings[0].getMessage()
