"""Gemma2 and Gemma3 (text): the single-rank engine against transformers on the same tiny weights.

The tiny models (tests/tiny_window_models.py) mix sliding layers (window 8) with a full one, and carry every
Gemma feature at a size where it changes the outputs (checked first, on transformers alone): the window,
Gemma2's attention soft-cap, the final soft-cap, query_pre_attn_scalar, and Gemma3's local rotary base and
linearly scaled global one. The prompts are up to 6 windows long. The same families also load from GGUF files
written as llama.cpp's converter writes them.
"""

from __future__ import annotations

import pytest

from cpllm import LLM, SamplingParams
from cpllm.model.loaders.safetensors_source import read_hf_config
from reference import check_against_hf, hf_greedy
from test_engine_vs_hf import random_prompts
from tiny_window_models import WINDOW, make_tiny_window_model, save_tiny_window_model, write_tiny_gemma_gguf

MAX_TOKENS = 24
PROMPT_LENGTHS = (1, 5, 3 * WINDOW + 6, 6 * WINDOW)
HYBRID = ("sliding_attention", "full_attention", "sliding_attention")
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2, prompt_logprobs=2)
FEATURES = [  # (family, the config change that removes one feature)
    ("gemma2", {"sliding_window": 256}),
    ("gemma2", {"attn_logit_softcapping": None}),
    ("gemma2", {"final_logit_softcapping": None}),
    ("gemma2", {"query_pre_attn_scalar": 16}),
    ("gemma3", {"sliding_window": 256}),
    ("gemma3", {"final_logit_softcapping": None}),
    ("gemma3", {"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 50000.0}}}),
    ("gemma3", {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 50000.0},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}}}),
]


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def tiny(request, tmp_path_factory):
    family = request.param
    folder = save_tiny_window_model(str(tmp_path_factory.mktemp(family)), family, seed=1)
    hf = make_tiny_window_model(family, seed=1)
    prompts = random_prompts(hf.config.vocab_size, PROMPT_LENGTHS, seed=4)
    refs = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    return family, folder, prompts, refs


def generate(folder, prompts, params, **options):
    with LLM(folder, max_model_len=256, block_size=4, **options) as llm:
        return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


@pytest.mark.parametrize(("family", "change"), FEATURES, ids=lambda v: v if isinstance(v, str) else "-".join(v))
def test_each_feature_changes_the_reference(family, change):
    """transformers with one Gemma feature removed gives other logprobs on the longest prompt."""
    prompt = random_prompts(300, PROMPT_LENGTHS, seed=4)[-1]
    _, _, with_it = hf_greedy(make_tiny_window_model(family, seed=1), prompt, 1)
    _, _, without = hf_greedy(make_tiny_window_model(family, seed=1, **change), prompt, 1)
    assert max(abs(a - b) for a, b in zip(with_it, without)) > 1e-2


def test_config_reads_every_field(tiny):
    family, folder, _, _ = tiny
    config = read_hf_config(folder)
    assert (config.sliding_window, config.layer_types) == (WINDOW, HYBRID)
    assert (config.query_pre_attn_scalar, config.final_logit_softcapping) == (24, 3.0)
    assert config.hidden_activation == "gelu_pytorch_tanh" and config.tie_word_embeddings
    if family == "gemma2":
        assert (config.attn_logit_softcapping, config.qk_norm, config.rope_local_theta) == (10.0, False, None)
    else:  # transformers' Gemma3 attention applies no score soft-cap
        assert (config.attn_logit_softcapping, config.qk_norm, config.rope_local_theta) == (None, True, 1000.0)
        assert (config.rope_theta, config.rope_scaling["rope_type"], config.rope_scaling["factor"]) == \
            (50000.0, "linear", 2.0)


def test_batch_of_mixed_lengths(tiny):
    _, folder, prompts, refs = tiny
    for output, ref in zip(generate(folder, prompts, GREEDY), refs):
        assert len(output.outputs[0].token_ids) == MAX_TOKENS
        check_against_hf(output, *ref)


def test_chunked_prefill_mixed_with_decodes(tiny):
    _, folder, prompts, refs = tiny
    for output, ref in zip(generate(folder, prompts, GREEDY, max_num_batched_tokens=7), refs):
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


GGUF_MODELS = {  # what llama.cpp decides without a key: the score scale from head_dim, Gemma 3's pattern and base
    "gemma2": dict(query_pre_attn_scalar=16),
    "gemma3": dict(query_pre_attn_scalar=16, num_hidden_layers=6, layer_types=None, rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
}


@pytest.mark.parametrize("family", sorted(GGUF_MODELS))
def test_gguf_file_as_llama_cpp_writes_it(family, tmp_path):
    hf = make_tiny_window_model(family, seed=5, **GGUF_MODELS[family])
    path = str(tmp_path / f"tiny-{family}.gguf")
    write_tiny_gemma_gguf(path, hf)
    folder = save_tiny_window_model(str(tmp_path / "hf"), family, seed=5, **GGUF_MODELS[family])
    from cpllm.model.loaders.gguf_source import GGUFSource

    gguf_config, hf_config = GGUFSource(path).config, read_hf_config(folder)
    for field in ("architecture", "sliding_window", "layer_types", "query_pre_attn_scalar", "attn_logit_softcapping",
                  "final_logit_softcapping", "rope_theta", "rope_local_theta", "qk_norm", "tie_word_embeddings"):
        assert getattr(gguf_config, field) == getattr(hf_config, field), field
    assert (gguf_config.rope_scaling or {}).get("factor") == (hf_config.rope_scaling or {}).get("factor")
    prompts = random_prompts(hf.config.vocab_size, (5, 6 * WINDOW), seed=6)
    outputs = generate(path, prompts, GREEDY, quantization="none")
    for output, prompt in zip(outputs, prompts):
        check_against_hf(output, *hf_greedy(hf, prompt, MAX_TOKENS))
