"""The gated-DeltaNet hybrids under TP, TP x DCP, PCP and TP x PCP x DCP (8 ranks) against transformers on the same tiny weights: each rank
holds num_key_heads / TP whole key heads of every DeltaNet layer, the value heads they serve and those heads' states
(DCP shards only the full layers' K/V: the TP ranks of a DCP group hold the same rows, so their states need
nothing more). Under PCP a prompt chunk is split over the PCP ranks and the states go through the state scan
(docs/context_parallel.md, "State scan"), with each KV layout and prefill strategy of the full layers; every PCP
rank then runs the decode rows alike. A 70-token prompt under a 32-token step budget runs chunked prefill (its
second and third chunks start from the state the first left) beside a decode row.
Greedy tokens identical and logprobs within 1e-4; layouts the kind does not run are refused by name."""

from __future__ import annotations

import random

import pytest

from cpllm import LLM, SamplingParams
from cpllm.config.engine import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from cpllm.model.loaders.safetensors_source import read_hf_config
from reference import check_against_hf, hf_greedy
from tiny_hybrid import make_tiny_hybrid, save_tiny_hybrid

MAX_TOKENS = 6
PARAMS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1, prompt_logprobs=1)
LAYOUTS = {
    "qwen3_5-tp2": ("qwen3_5", dict(tensor_parallel_size=2), {}),
    "qwen3_next-tp2": ("qwen3_next", dict(tensor_parallel_size=2), {}),  # fused projections, MoE, shared expert
    "qwen3_5-tp2-dcp2": ("qwen3_5", dict(tensor_parallel_size=2, decode_context_parallel_size=2),
                         dict(num_key_value_heads=1)),  # one KV head, replicated over the DCP group
    # PCP: each prompt chunk split head-tail over the PCP ranks, the DeltaNet states by the state scan
    "qwen3_5-pcp2": ("qwen3_5", dict(prefill_context_parallel_size=2), {}),  # sharded K/V, all-gather
    "qwen3_5-pcp2-repl-ring": ("qwen3_5", dict(prefill_context_parallel_size=2, cp_kv_cache_layout="replicated",
                                                cp_prefill_strategy="ring"), {}),  # decode rows not split over copies
    "qwen3_5_moe-pcp2-passq": ("qwen3_5_moe", dict(prefill_context_parallel_size=2, cp_prefill_strategy="pass-q",
                                                   cp_kv_cache_interleave_size=2), {}),
    "qwen3_next-tp2-pcp2": ("qwen3_next", dict(tensor_parallel_size=2, prefill_context_parallel_size=2), {}),
    # 8 ranks: the state scan over each TP rank's key head, the full layers' K/V sharded over PCP x DCP (each KV
    # head on a DCP group of two TP ranks)
    "qwen3_5-tp4-pcp2-dcp2": ("qwen3_5", dict(tensor_parallel_size=4, prefill_context_parallel_size=2,
                                              decode_context_parallel_size=2, cp_kv_cache_interleave_size=2),
                              dict(linear_num_key_heads=4, linear_num_value_heads=8)),
}
PCP_OPTIONS = dict(distributed_timeout=60)
"""Every collective of a PCP layout bounded: a broken step fails instead of hanging."""


@pytest.mark.parametrize("case", sorted(LAYOUTS))
def test_layout_matches_transformers(case, tmp_path):
    family, layout, overrides = LAYOUTS[case]
    folder = save_tiny_hybrid(str(tmp_path), family, seed=1, **overrides)
    hf = make_tiny_hybrid(family, seed=1, **overrides)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, hf.config.vocab_size) for _ in range(n)] for n in (5, 70)]
    refs = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    with LLM(folder, max_model_len=128, block_size=4, quantization="none", enable_prefix_caching=False,
             max_num_batched_tokens=32, **layout, **(PCP_OPTIONS if "pcp" in case else {})) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)
    for output, ref in zip(outputs, refs):
        assert len(output.outputs[0].token_ids) == MAX_TOKENS
        check_against_hf(output, *ref)


def test_tp_must_divide_the_key_heads(tmp_path):
    folder = save_tiny_hybrid(str(tmp_path), "qwen3_5", seed=1)
    with pytest.raises(ValueError, match="tensor_parallel_size=4 must divide linear_num_key_heads=2"):
        EngineConfig(model_path=folder, model=read_hf_config(folder), scheduler=SchedulerConfig(max_model_len=128),
                     cache=CacheConfig(enable_prefix_caching=False), parallel=ParallelConfig(tensor_parallel_size=4))
