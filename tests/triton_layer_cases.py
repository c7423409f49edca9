"""The CP attention layer on one rank with the gqa-triton backend, under Triton's interpreter (run by
tests/triton_interpret_cases.py, group "layer"): the same step as with the GQA backend (itself checked against
float64 attention and transformers), and the Triton kernels must have served the calls they can take."""

from __future__ import annotations

import torch

from cpllm.layers.gqa_triton import backend as triton_backend
from cpllm.context_parallel.attention import PagedCPAttention
from cpllm.distributed.parallel_context import ParallelContext
from cpllm.layers.gqa.backend import GQAPagedBackend
from cpllm.context_parallel.kv_layout import KVLayout
from cpllm.context_parallel.metadata import build_step_batch
from cpllm.context_parallel.plan import StepPath
from cpllm.layers.window.modifier import score_mods
from cpllm.step import ScheduledChunk
from step_plans import eager_plan

HQ, HKV, D, BLOCK = 4, 2, 16, 4
TOL = 2e-5
"""float32 against float32: the two backends accumulate in different orders (measured ~3e-7)."""


def _step(requests, plan, seed: int, pool_dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    layout = KVLayout(num_shards=1, shard_rank=0, interleave=1, block_size=BLOCK)
    chunks = [ScheduledChunk(request_id=str(i), token_ids=tuple([1] * new), start_pos=ctx,
                             block_table=tuple(range(1 + 16 * i, 17 + 16 * i)), sample=True, prompt_logits=False)
              for i, (ctx, new) in enumerate(requests)]
    meta = build_step_batch(chunks, layout, 1, 0, lambda c: [], plan=eager_plan(chunks, layout, path=plan)).attention
    pools = [torch.randn(16 * len(requests) * BLOCK + 2 * BLOCK, HKV, D, generator=g).to(pool_dtype)
             for _ in range(2)]
    q, k, v = (torch.randn(meta.num_rows, h, D, generator=g) for h in (HQ, HKV, HKV))
    return (q, k, v), pools, meta


def _counted(calls: dict, name: str):
    inner = getattr(triton_backend, name)

    def call(*args, **kwargs):
        calls[name] = calls.get(name, 0) + 1
        return inner(*args, **kwargs)
    return call


def layer_case(requests, plan=None, window=None, pool_dtype=torch.float32, seed=0, kernels=("prefill_attention",
               "paged_decode_attention")):
    (q, k, v), pools, meta = _step(requests, plan, seed, pool_dtype)
    scale = D**-0.5
    want = PagedCPAttention(ParallelContext(), scale=scale, backend=GQAPagedBackend(), mods=score_mods(window=window))(
        q, k, v, *[p.clone() for p in pools], meta)
    calls: dict = {}
    saved = {name: getattr(triton_backend, name) for name in kernels}
    for name in kernels:
        setattr(triton_backend, name, _counted(calls, name))
    try:
        k_pool, v_pool = (p.clone() for p in pools)
        got = PagedCPAttention(ParallelContext(), scale=scale, backend=triton_backend.TritonPagedBackend(),
                               mods=score_mods(window=window))(
            q, k, v, k_pool, v_pool, meta)
    finally:
        for name, fn in saved.items():
            setattr(triton_backend, name, fn)
    missing = [name for name in kernels if not calls.get(name)]
    if missing:
        raise AssertionError(f"the Triton kernels {missing} served no call (calls: {calls})")
    if got.dtype != want.dtype or got.shape != want.shape:
        raise AssertionError(f"out {got.dtype} {tuple(got.shape)}, want {want.dtype} {tuple(want.shape)}")
    return (got.double() - want.double()).abs().max().item(), TOL


def layer_cases() -> dict:
    mixed = [(0, 9), (6, 5), (10, 1), (40, 1), (0, 1)]  # prompt chunks with and without context, decodes
    decodes = [(10, 1), (3, 1), (37, 1)]
    return {
        "layer_mixed_prefill": lambda: layer_case(mixed),
        "layer_one_shard_decode": lambda: layer_case(decodes, kernels=("paged_decode_attention",)),
        "layer_gathered_decode_lse": lambda: layer_case(decodes, plan=StepPath.GATHERED_DECODE,
                                                        kernels=("paged_decode_attention",)),
        "layer_bf16_pools": lambda: layer_case(mixed, pool_dtype=torch.bfloat16, seed=1),
        # a window: context pieces are trimmed slices of the in-place keys, band-masked ones take the torch path
        "layer_window5": lambda: layer_case([(20, 9), (6, 5), (30, 1), (2, 1)], window=5, seed=2),
    }
