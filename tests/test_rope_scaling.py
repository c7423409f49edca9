"""RoPE scaling types (linear, dynamic, yarn, llama3) against transformers 5: the frequencies and attention factor
of each, the tables, and the engine end to end on tiny random Llamas whose prompts pass the original length."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from cpllm import LLM, SamplingParams
from cpllm.config.engine import ModelConfig
from cpllm.engine.llm import build_engine_config
from cpllm.model.rope import RotaryEmbedding, rope_parameters, yarn_mscale
from cpllm.model.loaders.loader import open_weights
from cpllm.model.loaders.safetensors_source import read_hf_config
from reference import check_against_hf, hf_greedy
from tiny_models import make_tiny_hf_model, save_tiny_gguf, save_tiny_hf_model

THETA = 50000.0
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
YARN_UNTRUNCATED = {**YARN, "truncate": False, "beta_fast": 8, "beta_slow": 0.5}
YARN_DEEPSEEK = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 0.707,
                 "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}
YARN_GPT_OSS = {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "truncate": False,
                "beta_fast": 32.0, "beta_slow": 1.0}
YARN_SET_FACTOR = {**YARN, "attention_factor": 0.8}
LINEAR = {"rope_type": "linear", "factor": 2.5}
DYNAMIC = {"rope_type": "dynamic", "factor": 2.0}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
CASES = {  # name -> (rope_scaling, max_position_embeddings)
    "yarn": (YARN, 64),
    "yarn-untruncated": (YARN_UNTRUNCATED, 64),
    "yarn-mscale": (YARN_DEEPSEEK, 163840),
    "yarn-gpt-oss": (YARN_GPT_OSS, 131072),
    "yarn-attention-factor": (YARN_SET_FACTOR, 64),
    "yarn-implied-factor": ({"rope_type": "yarn", "original_max_position_embeddings": 16, "factor": None}, 48),
    "linear": (LINEAR, 64),
    "dynamic": (DYNAMIC, 16),
    "dynamic-old-key": ({"type": "dynamic", "factor": 3.0}, 32),
    "llama3": (LLAMA3, 256),
}


def model_config(scaling, max_positions: int, head_dim: int = 16) -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=300, hidden_size=4 * head_dim, intermediate_size=64,
                       num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                       rope_theta=THETA, rope_scaling=dict(scaling), max_position_embeddings=max_positions)


def hf_config(scaling, max_positions: int, head_dim: int = 16) -> LlamaConfig:
    return LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                       max_position_embeddings=max_positions, rope_theta=THETA, rope_scaling=dict(scaling))


@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("name", sorted(CASES))
def test_frequencies_and_attention_factor_match_transformers(name, head_dim):
    scaling, max_positions = CASES[name]
    config = hf_config(scaling, max_positions, head_dim)
    kind = config.rope_parameters["rope_type"]
    # dynamic: transformers at a sequence of orig * factor tokens, the one length where its form is cpllm's
    extra = {"seq_len": int(max_positions * scaling["factor"])} if kind == "dynamic" else {}
    want_freq, want_factor = ROPE_INIT_FUNCTIONS[kind](config, "cpu", **extra)
    ours = model_config(scaling, max_positions, head_dim)
    got_freq, got_factor = rope_parameters(head_dim, THETA, ours.rope_scaling)
    torch.testing.assert_close(got_freq, want_freq, rtol=1e-6, atol=0)
    assert got_factor == pytest.approx(want_factor, rel=1e-12)


def test_dynamic_differs_from_transformers_at_other_lengths():
    """The fixed form is transformers' only at orig * factor: at a shorter length transformers' base is smaller."""
    config = hf_config(DYNAMIC, 16)
    shorter, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, "cpu", seq_len=24)
    ours, _ = rope_parameters(16, THETA, model_config(DYNAMIC, 16).rope_scaling)
    assert (ours - shorter).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["yarn", "yarn-mscale", "linear", "dynamic"])
def test_tables_match_transformers_rotary(name):
    """cos / sin rows (the attention factor included) equal LlamaRotaryEmbedding's at every position."""
    scaling, max_positions = CASES[name]
    positions = int(max_positions * scaling["factor"]) if name == "dynamic" else 64
    hf_rope = LlamaRotaryEmbedding(hf_config(scaling, max_positions))
    x = torch.zeros(1, positions, 16)
    want_cos, want_sin = hf_rope(x, torch.arange(positions)[None])  # [1, P, 16]
    ours = RotaryEmbedding(16, THETA, model_config(scaling, max_positions).rope_scaling, positions)
    cos, sin = ours.tables(torch.arange(positions), torch.float32)  # [P, 1, 16]
    torch.testing.assert_close(cos[:, 0], want_cos[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sin[:, 0, 8:], want_sin[0, :, 8:], rtol=1e-6, atol=1e-6)


def test_yarn_mscale():
    assert yarn_mscale(1.0) == 1.0 and yarn_mscale(0.5, 2.0) == 1.0
    assert yarn_mscale(40.0, 0.707) == pytest.approx(0.1 * 0.707 * 3.6888794541139363 + 1.0)
    assert yarn_mscale(4.0) == pytest.approx(rope_parameters(16, THETA, model_config(YARN, 64).rope_scaling)[1])


@pytest.mark.parametrize("scaling, message", [
    ({"rope_type": "longrope", "factor": 4.0, "short_factor": [1.0], "long_factor": [1.0]}, "'longrope'"),
    ({"type": "su", "factor": 2.0}, "'su'"),
    ({"rope_type": "linear"}, "factor=None"),
    ({"rope_type": "yarn", "factor": 0.5, "original_max_position_embeddings": 16}, "factor=0.5"),
    ({"rope_type": "dynamic", "factor": "2"}, "factor='2'"),
    ({"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 0}, "original_max_position_embeddings=0"),
])
def test_bad_rope_scaling_refused_at_configuration(scaling, message):
    with pytest.raises(ValueError, match=message):
        model_config(scaling, 64)


def test_resolved_scaling_is_resolved_again_unchanged():
    """dataclasses.replace re-runs the check on the completed dict: nothing moves."""
    for scaling, max_positions in CASES.values():
        config = model_config(scaling, max_positions)
        assert dataclasses.replace(config, quantization="none").rope_scaling == config.rope_scaling


def test_yarn_fields_survive_the_rope_parameters_fold(tmp_path):
    """transformers 5 writes rope_parameters; every yarn field reaches ModelConfig.rope_scaling."""
    scaling = {**YARN_UNTRUNCATED, "mscale": 0.707, "mscale_all_dim": 1.0}
    folder = save_tiny_hf_model(str(tmp_path), "llama", seed=0, max_position_embeddings=64,
                                rope_scaling=dict(scaling))  # transformers adds rope_theta to the dict it gets
    got = read_hf_config(folder).rope_scaling
    assert {k: got.get(k) for k in scaling} == scaling


# --- end to end: the engine against transformers on prompts past the original length -----------------------

E2E = {  # name -> (rope_scaling, max_position_embeddings, prompt length, greedy tokens)
    "yarn": (YARN, 128, 40, 8),
    "yarn-untruncated-mscale": ({**YARN_UNTRUNCATED, "mscale": 0.9, "mscale_all_dim": 0.5}, 128, 40, 8),
    "linear": ({"rope_type": "linear", "factor": 2.0}, 64, 40, 8),
    "dynamic": (DYNAMIC, 16, 24, 8),
}


def pin_dynamic(hf, length: int):
    """transformers' model with its dynamic frequencies for a `length`-token sequence kept for every length (the
    form cpllm and vLLM use); test_pinned_dynamic_is_transformers_at_its_length shows it is transformers' own
    there."""
    rotary = hf.model.rotary_emb
    inv_freq, _ = ROPE_INIT_FUNCTIONS["dynamic"](hf.config, "cpu", seq_len=length)
    rotary.inv_freq.copy_(inv_freq)
    rotary.rope_type = "default"  # transformers' per-forward update runs only for rope types named dynamic
    return hf


def test_pinned_dynamic_is_transformers_at_its_length():
    """On a sequence of exactly orig * factor tokens, transformers' own per-forward dynamic frequencies give the
    logits of the pinned model: the engine's reference past that is transformers at that length."""
    overrides = {"max_position_embeddings": 16, "rope_scaling": dict(DYNAMIC)}
    ids = torch.tensor([random.Random(7).choices(range(3, 300), k=32)])
    with torch.no_grad():
        own = make_tiny_hf_model("llama", seed=3, **overrides)(ids).logits
        pinned = pin_dynamic(make_tiny_hf_model("llama", seed=3, **overrides), 32)(ids).logits
        shorter = pinned[:, :24] - make_tiny_hf_model("llama", seed=3, **overrides)(ids[:, :24]).logits
    torch.testing.assert_close(pinned, own, rtol=0, atol=1e-5)
    assert shorter.abs().max() > 1e-3  # at other lengths transformers' frequencies are others


@pytest.mark.parametrize("name", sorted(E2E))
def test_engine_matches_transformers_past_original_length(name, tmp_path):
    scaling, max_positions, prompt_len, max_tokens = E2E[name]
    overrides = {"max_position_embeddings": max_positions, "rope_scaling": dict(scaling)}
    folder = save_tiny_hf_model(str(tmp_path), "llama", seed=3, **overrides)
    hf = make_tiny_hf_model("llama", seed=3, **overrides)
    context = prompt_len + max_tokens
    if name == "dynamic":
        hf = pin_dynamic(hf, int(max_positions * scaling["factor"]))
        assert context == max_positions * scaling["factor"]  # the engine's whole context, past orig = 16
    rng = random.Random(5)
    prompts = [[rng.randrange(3, hf.config.vocab_size) for _ in range(prompt_len)], [rng.randrange(3, 300)] * 5]
    refs = [hf_greedy(hf, p, max_tokens) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    with LLM(folder, max_model_len=context, block_size=4, max_num_batched_tokens=12) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for output, ref in zip(outputs, refs):
        assert len(output.outputs[0].token_ids) == max_tokens
        check_against_hf(output, *ref)


def test_max_model_len_limited_by_the_scaled_context(tmp_path):
    """dynamic stretches max_position_embeddings by factor, and no further."""
    folder = save_tiny_hf_model(str(tmp_path), "llama", seed=0, max_position_embeddings=16,
                                rope_scaling=dict(DYNAMIC))
    assert build_engine_config(folder, max_model_len=32).scheduler.max_model_len == 32
    with pytest.raises(ValueError, match="max_model_len=33 exceeds the model's context of 32"):
        build_engine_config(folder, max_model_len=33)


@pytest.mark.parametrize("scaling", [YARN, {"rope_type": "linear", "factor": 2.0}], ids=["yarn", "linear"])
def test_gguf_rope_scaling_reads_as_the_hf_folder_does(scaling, tmp_path):
    """llama.cpp's rope.scaling.* keys give the rope_scaling the Hugging Face folder of the same model gives."""
    overrides = {"max_position_embeddings": 128, "rope_scaling": dict(scaling)}
    save_tiny_gguf(str(tmp_path / "tiny.gguf"), "llama", seed=3, tensor_types={}, **overrides)
    folder = save_tiny_hf_model(str(tmp_path / "hf"), "llama", seed=3, **overrides)
    got = open_weights(str(tmp_path / "tiny.gguf")).config.rope_scaling
    want = read_hf_config(folder).rope_scaling
    assert {k: v for k, v in got.items() if k != "type"} == {k: v for k, v in want.items() if k != "type"}


def test_gguf_yarn_engine_matches_transformers(tmp_path):
    overrides = {"max_position_embeddings": 128, "rope_scaling": dict(YARN)}
    path = str(tmp_path / "tiny.gguf")
    save_tiny_gguf(path, "llama", seed=3, tensor_types={}, **overrides)  # float32 tensors: transformers' weights
    hf = make_tiny_hf_model("llama", seed=3, **overrides)
    prompt = random.Random(9).choices(range(3, 300), k=40)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    with LLM(path, max_model_len=48, block_size=4, quantization="none") as llm:
        output = llm.generate([{"prompt_token_ids": prompt}], params)[0]
    check_against_hf(output, *hf_greedy(hf, prompt, 8))


@pytest.mark.parametrize("key, value, message", [
    ("type", "longrope", "'longrope'"),
    ("yarn_log_multiplier", 0.1, "yarn_log_multiplier"),
])
def test_gguf_rope_scaling_refused(key, value, message, tmp_path, monkeypatch):
    import tiny_models

    path = str(tmp_path / "tiny.gguf")
    add = tiny_models._add_rope_scaling

    def add_then_key(writer, params):  # the converter's keys, then the one under test
        add(writer, params)
        writer.add_string(f"llama.rope.scaling.{key}", value) if isinstance(value, str) else \
            writer.add_float32(f"llama.rope.scaling.{key}", value)

    monkeypatch.setattr(tiny_models, "_add_rope_scaling", add_then_key)
    save_tiny_gguf(path, "llama", seed=3, tensor_types={}, max_position_embeddings=128, rope_scaling=dict(YARN))
    with pytest.raises(ValueError, match=message):
        open_weights(path)
