"""Mistral, Qwen2, Mixtral, Qwen3 and Qwen3-MoE with sliding windows: the single-rank engine against transformers
on the same tiny weights.

The window is 8 tokens (tests/tiny_window_models.py) and the prompts up to 6 times as long, so most keys of the
long prompts and of the decode steps have left the window; Qwen2's and Qwen3's first layer attends fully
(max_window_layers=1), so those models mix both kinds; Mixtral and Qwen3-MoE slide on every layer through their
experts.
"""

from __future__ import annotations

import logging

import pytest

from cpllm import LLM, SamplingParams
from cpllm.model.loaders.safetensors_source import read_hf_config
from reference import check_against_hf, hf_greedy
from test_engine_vs_hf import random_prompts
from tiny_window_models import WINDOW, make_tiny_window_model, save_tiny_window_model

MAX_TOKENS = 24
PROMPT_LENGTHS = (1, 5, 3 * WINDOW + 6, 6 * WINDOW)
FAMILIES = {
    "mistral": ("sliding_attention",) * 2,
    "qwen2": ("full_attention", "sliding_attention", "sliding_attention"),
    "mixtral": ("sliding_attention",) * 2,
    "qwen3": ("full_attention", "sliding_attention", "sliding_attention"),
    "qwen3_moe": ("sliding_attention",) * 2,
}
"""family -> the layer kinds its tiny config must be read as."""
NO_WINDOW = {"mistral": {"sliding_window": None}, "qwen2": {"use_sliding_window": False},
             "mixtral": {"sliding_window": None}, "qwen3": {"use_sliding_window": False},
             "qwen3_moe": {"use_sliding_window": False}}
ONE_FULL_LAYER = ("qwen2", "qwen3")
"""Families whose tiny layer 0 attends fully (max_window_layers=1)."""
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2, prompt_logprobs=2)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def tiny(request, tmp_path_factory):
    family = request.param
    folder = save_tiny_window_model(str(tmp_path_factory.mktemp(family)), family, seed=1)
    hf = make_tiny_window_model(family, seed=1)
    prompts = random_prompts(hf.config.vocab_size, PROMPT_LENGTHS, seed=3)
    refs = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    return family, folder, prompts, refs


def generate(folder, prompts, params, **options):
    with LLM(folder, max_model_len=256, block_size=4, **options) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return outputs, llm.engine.scheduler.num_prefix_hit_tokens


def test_config_names_the_windowed_layers(tiny):
    family, folder, _, _ = tiny
    config = read_hf_config(folder)
    assert (config.sliding_window, config.layer_types) == (WINDOW, FAMILIES[family])


def test_the_window_changes_the_reference(tiny):
    """Without its window the same weights give other logprobs on these prompts: the comparisons below see it."""
    family, _, prompts, refs = tiny
    unwindowed = make_tiny_window_model(family, seed=1, **NO_WINDOW[family])
    _, _, prompt_lp = hf_greedy(unwindowed, prompts[-1], 1)
    assert max(abs(a - b) for a, b in zip(prompt_lp, refs[-1][2])) > 1e-2


def test_batch_of_mixed_lengths(tiny, caplog):
    family, folder, prompts, refs = tiny
    with caplog.at_level(logging.INFO, logger="cpllm.model.families.llama"):
        outputs, _ = generate(folder, prompts, GREEDY)
    for output, ref in zip(outputs, refs):
        assert len(output.outputs[0].token_ids) == MAX_TOKENS
        check_against_hf(output, *ref)
    # the start-up log: each group of layers with its kind, window and K/V bytes (a windowed layer keeps its last
    # WINDOW = 8 positions: 8 tokens x 2 heads x 16 x K, V x 4 bytes = 2 KiB; a full one all 256: 64 KiB per layer),
    # and no fused decode layers
    sliding = "layers 1-2 (2)" if family in ONE_FULL_LAYER else "layers 0-1 (2)"
    assert (f"{sliding}: sliding window of {WINDOW} tokens; K/V of one 256-token request: 2.0 KiB per layer on this "
            f"rank (its last {WINDOW} positions, plus at most one block)") in caplog.text
    if family in ONE_FULL_LAYER:
        assert "layers 0 (1): full attention; K/V of one 256-token request: 64.0 KiB per layer" in caplog.text
    assert ("layers 0 (1): full attention" in caplog.text) == (family in ONE_FULL_LAYER)
    assert "decode steps: eager layers (sliding-window attention)" in caplog.text


def test_chunked_prefill_mixed_with_decodes(tiny):
    _, folder, prompts, refs = tiny
    outputs, _ = generate(folder, prompts, GREEDY, max_num_batched_tokens=7)
    for output, ref in zip(outputs, refs):
        check_against_hf(output, *ref)


def test_prefix_cache_hits(tiny):
    _, folder, prompts, refs = tiny
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    with LLM(folder, max_model_len=256, block_size=4) as llm:
        token_prompts = [{"prompt_token_ids": p} for p in prompts]
        first = llm.generate(token_prompts, params)
        second = llm.generate(token_prompts, params)
        assert llm.engine.scheduler.num_prefix_hit_tokens >= 40  # the 48-token prompt hits 11 blocks at least
    for a, b, ref in zip(first, second, refs):
        check_against_hf(a, ref[0], ref[1])
        check_against_hf(b, ref[0], ref[1])
