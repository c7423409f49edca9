"""DeepSeek-V2, DeepSeek-V3 and GLM-4.7-Flash on the single-rank engine against transformers on the same tiny random
weights (tests/tiny_deepseek.py: q_lora_rank set and unset, YaRN on and off, a dense first layer, shared experts,
each router kind, sharp routing). Greedy tokens identical, prompt and sampled-token logprobs within 1e-4.

Each case: a batch of prompts of mixed lengths with prompt logprobs (fresh prefill, then decode), and one run with
a small chunked-prefill budget where the second pass over the same prompts hits the prefix cache, so chunked
prefill over cached latents, prefix hits and decode run in one engine.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from cpllm import LLM, SamplingParams
from cpllm.config.engine import ModelConfig
from cpllm.model.loaders.safetensors_source import read_hf_config
from reference import check_against_hf, hf_greedy
from tiny_deepseek import CASES, make_tiny_deepseek, save_tiny_deepseek

MAX_TOKENS = 12
PROMPT_LENGTHS = (1, 5, 17, 40)
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2, prompt_logprobs=2)


def random_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module", params=sorted(CASES))
def tiny(request, tmp_path_factory):
    folder = save_tiny_deepseek(str(tmp_path_factory.mktemp(request.param)), request.param, seed=1)
    hf = make_tiny_deepseek(request.param, seed=1)
    prompts = random_prompts(hf.config.vocab_size)
    return request.param, folder, prompts, [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]


def test_config_reads_each_family(tiny):
    name, folder, _, _ = tiny
    config = read_hf_config(folder)
    assert isinstance(config, ModelConfig) and config.mla is not None
    assert (config.num_key_value_heads, config.head_dim) == (1, 32)  # one latent head; q/k width nope + rope
    assert config.mla.latent_width == 48
    assert config.moe.mlp_only_layers == (0,)  # the dense first layer
    assert config.moe.deepseek_router.scoring_func == ("softmax" if name.startswith("v2") else "sigmoid")
    assert (config.mla.q_lora_rank is None) == (name in ("v2", "v3-direct"))
    assert (config.rope_scaling is not None) == name.endswith("yarn")


def test_batch_matches_transformers(tiny):
    _, folder, prompts, refs = tiny
    with LLM(folder, max_model_len=256, block_size=4, quantization="none") as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    for output, ref in zip(outputs, refs):
        assert len(output.outputs[0].token_ids) == MAX_TOKENS
        check_against_hf(output, *ref)


def test_chunked_prefill_and_prefix_hits(tiny):
    _, folder, prompts, refs = tiny
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    with LLM(folder, max_model_len=256, block_size=4, quantization="none", max_num_batched_tokens=7) as llm:
        token_prompts = [{"prompt_token_ids": p} for p in prompts]
        first = llm.generate(token_prompts, params)
        second = llm.generate(token_prompts, params)
        assert llm.engine.scheduler.num_prefix_hit_tokens >= 36  # the 40-token prompt hits 9 blocks at least
    for a, b, ref in zip(first, second, refs):
        check_against_hf(a, ref[0], ref[1])
        check_against_hf(b, ref[0], ref[1])


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_mla_dcp_may_be_any_divisor_of_tp(tiny, tp):
    """One latent head, replicated on every TP rank: every DCP dividing TP is accepted (a GQA model with 2 KV
    heads accepts only DCP <= TP / 2), and any other DCP is refused naming the MLA rule."""
    from cpllm.config.engine import ParallelConfig
    from cpllm.distributed.parallel_dims import valid_dcp_sizes

    name, folder, _, _ = tiny
    if name != "v3-yarn":
        pytest.skip("a config rule: one family suffices")
    config = dataclasses.replace(read_hf_config(folder), num_attention_heads=8)  # heads for TP up to 8
    assert valid_dcp_sizes(tp, config.num_key_value_heads) == [d for d in range(1, tp + 1) if tp % d == 0]
    for dcp in range(1, tp + 1):
        if tp % dcp == 0:
            ParallelConfig(tensor_parallel_size=tp, decode_context_parallel_size=dcp).dims.validate(config)
        else:
            with pytest.raises(ValueError, match="multi-head latent attention, whose one latent head every TP rank"):
                ParallelConfig(tensor_parallel_size=tp, decode_context_parallel_size=dcp)
    with pytest.raises(ValueError, match="different KV heads"):  # the GQA rule it replaces
        ParallelConfig(tensor_parallel_size=tp, decode_context_parallel_size=tp).dims.validate(
            dataclasses.replace(config, mla=None, num_key_value_heads=2))


def test_preemption_keeps_every_request(tiny):
    """A latent cache too small for the batch: requests are preempted and recomputed, outputs unchanged."""
    _, folder, prompts, refs = tiny
    # 3 layers x one latent pool x 4 tokens x 48 values x 4 bytes = 2,304 bytes per block; 13 blocks = 52 tokens,
    # the longest request alone, where the four need 30 blocks together
    with LLM(folder, max_model_len=52, block_size=4, quantization="none", kv_cache_memory_bytes=13 * 2304) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
        assert llm.engine.executor.rank_info.kv.num_blocks == 13
        assert llm.engine.scheduler.num_preemptions > 0
    for output, ref in zip(outputs, refs):
        assert len(output.outputs[0].token_ids) == MAX_TOKENS
        check_against_hf(output, *ref)
