"""PagedCPAttention on one rank against plain attention over each request's whole sequence."""

from __future__ import annotations

import pytest
import torch

from cpllm.context_parallel.attention import PagedCPAttention
from cpllm.distributed.parallel_context import ParallelContext
from cpllm.context_parallel.kv_layout import KVLayout
from cpllm.context_parallel.metadata import build_step_batch
from cpllm.layers.gqa.shared_keys import shared_key_view
from cpllm.context_parallel.sdpa import reference_attention
from cpllm.step import ScheduledChunk
from step_plans import eager_plan

HQ, HKV, D, BLOCK = 4, 2, 8, 4


def run_case(requests, seed=0):
    """requests: (context_len, num_new, block_table). Returns (max abs error, metadata)."""
    g = torch.Generator().manual_seed(seed)
    num_slots = 64 * BLOCK
    k_pool, v_pool = torch.randn(num_slots, HKV, D, generator=g), torch.randn(num_slots, HKV, D, generator=g)
    layout = KVLayout(num_shards=1, shard_rank=0, interleave=1, block_size=BLOCK)
    chunks = [ScheduledChunk(request_id=str(i), token_ids=tuple([1] * new), start_pos=ctx, block_table=tuple(bt),
                             sample=True, prompt_logits=False) for i, (ctx, new, bt) in enumerate(requests)]
    batch = build_step_batch(chunks, layout, 1, 0, lambda c: [], plan=eager_plan(chunks, layout))
    n = batch.attention.num_rows
    q, k, v = (torch.randn(n, h, D, generator=g) for h in (HQ, HKV, HKV))
    # Snapshot each request's cached context before the layer writes the new tokens.
    contexts = [(k_pool[[layout.slot(p, bt) for p in range(ctx)]].clone(),
                 v_pool[[layout.slot(p, bt) for p in range(ctx)]].clone()) for ctx, _, bt in requests]
    out = PagedCPAttention(ParallelContext(), scale=D**-0.5)(q, k, v, k_pool, v_pool, batch.attention)
    error, row = 0.0, 0
    for (ctx, new, _), (k_ctx, v_ctx) in zip(requests, contexts):
        keys = torch.cat((k_ctx, k[row : row + new])).transpose(0, 1)[None]
        values = torch.cat((v_ctx, v[row : row + new])).transpose(0, 1)[None]
        mask = torch.arange(ctx + new)[None, :] <= (ctx + torch.arange(new))[:, None]  # causal by position
        want, _ = reference_attention(q[row : row + new].transpose(0, 1)[None], keys, values, scale=D**-0.5,
                                      mask=mask)
        error = max(error, (out[row : row + new] - want[0].transpose(0, 1)).abs().max().item())
        row += new
    return error, batch.attention


def test_prefill_chunks_with_context_and_decodes():
    requests = [(0, 9, [0, 1, 2]), (6, 5, [3, 4, 5]), (10, 1, [6, 7, 8]), (3, 1, [9]), (5, 1, [10, 11])]
    error, meta = run_case(requests)
    assert error < 1e-5 and meta.decode is not None and not meta.decode.shared_keys


@pytest.mark.parametrize("num_decodes", [2, 6])
def test_decodes_sharing_a_prefix_read_the_shared_keys_once(num_decodes):
    shared = [10, 11, 12, 13]  # 16 cached tokens in common, then one private block each
    requests = [(17, 1, shared + [20 + i]) for i in range(num_decodes)] + [(0, 5, [40, 41])]
    error, meta = run_case(requests, seed=num_decodes)
    assert error < 1e-5 and shared_key_view(meta.decode).shared_keys
