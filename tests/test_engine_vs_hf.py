"""The single-rank engine against Hugging Face transformers on the same tiny random weights."""

from __future__ import annotations

import random

import pytest
import torch

from cpllm import LLM, SamplingParams
from reference import check_against_hf, hf_greedy
from tiny_models import make_tiny_hf_model, save_tiny_hf_model

MAX_TOKENS = 32
PROMPT_LENGTHS = (1, 5, 17, 40)
MODELS = {
    "llama-gqa": ("llama", {}),
    "qwen2-bias": ("qwen2", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama3-rope": ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
}


def random_prompts(vocab_size: int, lengths, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module", params=sorted(MODELS))
def tiny(request, tmp_path_factory):
    arch, overrides = MODELS[request.param]
    folder = save_tiny_hf_model(str(tmp_path_factory.mktemp(request.param)), arch, seed=1, **overrides)
    hf = make_tiny_hf_model(arch, seed=1, **overrides)
    prompts = random_prompts(hf.config.vocab_size, PROMPT_LENGTHS)
    refs = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    return folder, prompts, refs


def run(folder, prompts, params, **options):
    with LLM(folder, max_model_len=256, block_size=4, **options) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        stats = llm.engine.scheduler
        return outputs, stats.num_preemptions, stats.num_prefix_hit_tokens


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2, prompt_logprobs=2)


def test_batch_of_mixed_lengths(tiny):
    folder, prompts, refs = tiny
    outputs, _, _ = run(folder, prompts, GREEDY)
    for output, ref in zip(outputs, refs):
        assert len(output.outputs[0].token_ids) == MAX_TOKENS
        assert output.outputs[0].finish_reason == "length"
        check_against_hf(output, *ref)


def test_chunked_prefill(tiny):
    folder, prompts, refs = tiny
    outputs, _, _ = run(folder, prompts, GREEDY, max_num_batched_tokens=7)
    for output, ref in zip(outputs, refs):
        check_against_hf(output, *ref)


def test_prefix_cache_hits(tiny):
    folder, prompts, refs = tiny
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    with LLM(folder, max_model_len=256, block_size=4) as llm:
        token_prompts = [{"prompt_token_ids": p} for p in prompts]
        first = llm.generate(token_prompts, params)
        second = llm.generate(token_prompts, params)
        assert llm.engine.scheduler.num_prefix_hit_tokens >= 36  # the 40-token prompt hits 9 blocks at least
    for a, b, ref in zip(first, second, refs):
        check_against_hf(a, ref[0], ref[1])
        check_against_hf(b, ref[0], ref[1])


def test_preemption_keeps_every_request(tiny):
    folder, prompts, refs = tiny
    # 2 layers x K,V x 4 tokens x 2 KV heads x 16 dims x 4 bytes = 2 KiB per block; 24 blocks = 96 tokens.
    outputs, preemptions, _ = run(folder, prompts, GREEDY, kv_cache_memory_bytes=24 * 2048)
    assert preemptions > 0
    for output, ref in zip(outputs, refs):
        assert len(output.outputs[0].token_ids) == MAX_TOKENS
        check_against_hf(output, *ref)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_file_matches_transformers_reading_it(arch, tmp_path):
    """Tiny GGUF (float and quantized tensors) through cpllm and through transformers' GGUF reader."""
    pytest.importorskip("accelerate")  # transformers needs it to read GGUF
    from transformers import AutoModelForCausalLM

    from tiny_models import save_tiny_gguf

    path = tmp_path / f"tiny-{arch}.gguf"
    save_tiny_gguf(str(path), arch, seed=2)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    prompts = random_prompts(hf.config.vocab_size, (3, 21), seed=5)
    # quantization="none": the Q4/Q8 blocks dequantized to fp32, the weights transformers runs
    with LLM(str(path), max_model_len=256, block_size=4, quantization="none") as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    for output, prompt in zip(outputs, prompts):
        check_against_hf(output, *hf_greedy(hf, prompt, MAX_TOKENS))
