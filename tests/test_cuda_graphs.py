"""The device-independent part of the CUDA-graph decode (cpllm/model/execution/cuda_graphs.py): buckets, the choice of a
bucket, every reason to run eager (logged once), and the static buffers: a step written into them (padded to its
bucket) and attended through the metadata the graphs are captured with gives the step's own outputs and K/V
writes. Capture and replay themselves run on CUDA only (scripts/gpu_check.sh)."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from cpllm.context_parallel.attention import PagedCPAttention
from cpllm.distributed.parallel_context import ParallelContext
from cpllm.layers.gqa.backend import GQAPagedBackend
from cpllm.context_parallel.kv_layout import KVLayout
from cpllm.context_parallel.metadata import build_step_batch
from cpllm.context_parallel.plan import GraphBuckets, RankCapabilities, StepPath, plan_step
from cpllm.step import ScheduledChunk
from cpllm.model.execution.cuda_graphs import (FallbackLog, StaticDecodeInputs, bucket_for, capture_sizes, model_reason,
                                      sizes_within_memory, step_reason)
from step_plans import eager_plan

HQ, HKV, D, BLOCK = 4, 2, 8, 4


def test_capture_sizes_cover_every_batch_up_to_max_num_seqs():
    assert capture_sizes(1) == (1,)
    assert capture_sizes(10) == (1, 2, 4, 8, 10)
    assert capture_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert capture_sizes(4096)[-1] == 512 and len(capture_sizes(4096)) == 3 + 64
    for max_num_seqs in (1, 3, 10, 64, 100):
        sizes = capture_sizes(max_num_seqs)
        assert all(bucket_for(sizes, b) is not None for b in range(1, max_num_seqs + 1))


def test_bucket_is_the_smallest_size_that_holds_the_batch():
    sizes = (1, 2, 4, 8, 16)
    assert [bucket_for(sizes, b) for b in (1, 2, 3, 5, 8, 9, 16)] == [1, 2, 4, 8, 8, 16, 16]
    assert bucket_for(sizes, 17) is None


def test_buckets_are_bounded_by_the_static_slot_table():
    assert sizes_within_memory((1, 2, 4, 8), width=1 << 20, budget=16 << 20) == (1, 2, 4)


def test_model_reasons():
    ok = dict(device=torch.device("cuda"), enforce_eager=False, backend_name="gqa-triton", replica_ranks=1,
              scored_layers=False, moe=False)
    assert model_reason(**ok) is None
    for change, words in [({"device": torch.device("cpu")}, "device cpu"), ({"enforce_eager": True}, "enforce_eager"),
                          ({"backend_name": "gqa"}, "Triton kernels"), ({"replica_ranks": 2}, "replica of 2"),
                          ({"scored_layers": True}, "sliding window"), ({"moe": True}, "mixture-of-experts")]:
        assert words in model_reason(**{**ok, **change})


def _chunks(requests):
    return [ScheduledChunk(request_id=str(i), token_ids=tuple([5 + i] * new), start_pos=ctx,
                           block_table=tuple(range(1 + 16 * i, 17 + 16 * i)), sample=True, prompt_logits=False)
            for i, (ctx, new) in enumerate(requests)]


def _batch(requests, path=StepPath.ONE_SHARD):
    layout = KVLayout(num_shards=1, shard_rank=0, interleave=1, block_size=BLOCK)
    chunks = _chunks(requests)
    plan = eager_plan(chunks, layout, path=path)  # a prompt chunk plans a prefill
    return build_step_batch(chunks, layout, 1, 0, lambda c: [len(c.token_ids) - 1], plan=plan), layout


def test_step_reasons():
    sizes = (1, 2, 4)
    assert step_reason(_batch([(10, 1), (3, 1)])[0], sizes, width=64) is None
    assert step_reason(_batch([(10, 4), (3, 1)])[0], sizes, width=64) == "plan prefill"
    assert step_reason(_batch([(10, 1)], StepPath.GATHERED_DECODE)[0], sizes, 64) == "plan gathered-decode"
    assert "batch of 5 rows over the largest captured size 4" in step_reason(_batch([(3, 1)] * 5)[0], sizes, 64)
    assert "context of 41 slots over the captured width 40" in step_reason(_batch([(40, 1)])[0], sizes, 40)


def test_fallback_reasons_are_logged_once_and_counted(caplog):
    log = FallbackLog()
    with caplog.at_level(logging.INFO, logger="cpllm.model.execution.cuda_graphs"):
        for reason in ("plan prefill", "plan prefill", "batch of 9 rows", "plan prefill"):
            log.note(reason)
    assert log.counts == {"plan prefill": 3, "batch of 9 rows": 1}
    assert sum("plan prefill" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("requests, size", [([(10, 1), (3, 1), (21, 1)], 4), ([(7, 1)], 1), ([(30, 1), (2, 1)], 8)])
def test_a_step_in_the_static_buffers_attends_as_the_step_itself(requests, size):
    """Rows [:B] of the padded bucket give the step's outputs; rows B.. repeat row B-1 (same K/V to the same slot),
    so the pools end equal too. Slot tables are int32 in the buffers, wider than the step's and stale past each
    length."""
    batch, layout = _batch(requests)
    meta = batch.attention
    g = torch.Generator().manual_seed(size)
    pools = [torch.randn(16 * len(requests) * BLOCK + BLOCK, HKV, D, generator=g) for _ in range(2)]
    rows = len(requests)
    q, k, v = (torch.randn(rows, h, D, generator=g) for h in (HQ, HKV, HKV))
    layer = PagedCPAttention(ParallelContext(), scale=D**-0.5, backend=GQAPagedBackend())
    want_pools = [p.clone() for p in pools]
    want = layer(q, k, v, *want_pools, meta)

    static = StaticDecodeInputs.allocate(16, width=48, device="cpu")
    static.slots.fill_(10**6)  # stale garbage past every length: never read
    static.fill(batch, size)
    assert torch.equal(static.token_ids[:rows], batch.token_ids)
    assert torch.equal(static.token_ids[rows:size], batch.token_ids[-1].expand(size - rows))
    assert torch.equal(static.lengths[:rows].long(), meta.decode.lengths)
    pad = lambda t: torch.cat((t, t[-1:].expand(size - rows, *t.shape[1:])))  # noqa: E731 - what the model sees
    got_pools = [p.clone() for p in pools]
    got = layer(pad(q), pad(k), pad(v), *got_pools, static.metadata(size, layout))
    assert got.shape[0] == size and torch.allclose(got[:rows], want, atol=1e-6, rtol=0)
    assert torch.allclose(got[rows:], want[-1:].expand(size - rows, *want.shape[1:]), atol=1e-6, rtol=0)
    assert all(torch.equal(a, b) for a, b in zip(got_pools, want_pools))


class _EagerReplay:
    """Stands in for a captured graph on the CPU: a replay reruns the captured forward on the static buffers into
    the same output tensor, which is what a CUDA graph's replay does."""

    def __init__(self, graphs, size: int):
        self.graphs, self.size = graphs, size

    def replay(self) -> None:
        self.graphs.outputs[self.size].copy_(self.graphs._forward(self.size))


@torch.no_grad()
def test_decode_steps_through_the_buckets_give_the_eager_model_s_hidden_states(tmp_path):
    """A tiny Llama: prompts prefilled eagerly, then decode steps of 3 and 1 rows run through `DecodeGraphs.run`
    (buckets 1, 2, 4; replays simulated on the CPU) give the hidden states and pool contents of the model run on
    the steps' own metadata; a step the buckets cannot take returns None (eager) with its reason counted."""
    from tiny_models import save_tiny_hf_model

    from cpllm.model.families.llama import LlamaForCausalLM
    from cpllm.model.loaders.loader import open_weights
    from cpllm.model.execution.cuda_graphs import DecodeGraphs

    folder = save_tiny_hf_model(str(tmp_path / "tiny"), seed=4)
    source = open_weights(folder)
    model = LlamaForCausalLM(source.config, ParallelContext(), torch.float32, 128)
    model.load_weights(source)
    layers, hkv, d = source.config.num_hidden_layers, source.config.num_key_value_heads, source.config.head_dim
    pools = [(torch.zeros(64 * BLOCK, hkv, d), torch.zeros(64 * BLOCK, hkv, d)) for _ in range(layers)]
    layout = KVLayout(num_shards=1, shard_rank=0, interleave=1, block_size=BLOCK)
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18], [19]]
    tables = [tuple(range(1 + 12 * i, 13 + 12 * i)) for i in range(len(prompts))]

    caps = RankCapabilities(graphs=GraphBuckets(sizes=(1, 2, 4), width=40))  # the graphs built below

    def step(members, starts, tokens):
        chunks = [ScheduledChunk(request_id=str(i), token_ids=tuple(tokens[i]), start_pos=starts[i],
                                 block_table=tables[i], sample=True, prompt_logits=False) for i in members]
        return build_step_batch(chunks, layout, 1, 0, lambda c: [len(c.token_ids) - 1], plan=plan_step(chunks, caps))

    prefill = step(range(4), [0] * 4, prompts)
    model(prefill.token_ids, prefill.positions, pools, prefill.attention)
    graphs = DecodeGraphs(model, pools, layout, sizes=(1, 2, 4), width=40, device=torch.device("cpu"))
    for size in graphs.sizes:
        graphs.outputs[size] = torch.empty(size, source.config.hidden_size)
        graphs.graphs[size] = _EagerReplay(graphs, size)
    starts = [len(p) for p in prompts]
    for members, token in [((0, 1, 2), 30), ((3,), 31), ((0, 2, 3), 32)]:
        batch = step(members, starts, {i: [token + i] for i in members})
        eager_pools = [(k.clone(), v.clone()) for k, v in pools]
        want = model(batch.token_ids, batch.positions, eager_pools, batch.attention)
        got = graphs.run(batch)
        assert got is not None and got.shape == want.shape
        assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()
        # the same slots written, to float32 rounding (a batch of 4 rows multiplies in another order than one of 3)
        assert all(torch.allclose(a, b, atol=1e-5, rtol=0) for pair, eager in zip(pools, eager_pools)
                   for a, b in zip(pair, eager))
        for i in members:
            starts[i] += 1
    assert graphs.replays == 3
    five = step(range(4), starts, {i: [40] for i in range(4)})
    five = dataclasses.replace(five, token_ids=torch.cat((five.token_ids, five.token_ids[:1])))  # 5 rows: no bucket
    assert graphs.run(five) is None and list(graphs.fallbacks.counts) == ["decode rows are not every row of the step"]
