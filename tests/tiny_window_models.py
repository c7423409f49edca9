"""Tiny random models of the families with sliding-window or hybrid attention, built on the spot with
transformers 5 configs (nothing is downloaded): Mistral, Qwen2 with `use_sliding_window`, Gemma2, Gemma3 (text),
and the MoE / q-k-norm families of tests/tiny_moe_models.py with a window: Mixtral, Qwen3, Qwen3-MoE.

- `window_hf_config(family, **overrides)`: the transformers config;
- `make_tiny_window_model(family, seed=, **overrides)`: the random transformers model (float32, eval), weights
  randomized as tests/tiny_models.py does (norms, biases, sharpened q/k);
- `save_tiny_window_model(folder, family, seed=, **overrides)`: the same model as a Hugging Face folder with the
  tiny tokenizer;
- `write_tiny_gemma_gguf(path, model)`: a Gemma model as llama.cpp's converter writes it (gemma2 / gemma3 names,
  norm weights stored as 1 + w, the window and soft-caps in the metadata), every tensor F32.

Shapes are tests/tiny_models.py's (vocab 300, hidden 64, 4 heads of 16, 2 KV heads, MLP 128, 256 positions)
with a window of WINDOW tokens, so prompts a few times the window reach keys that have left it:
- "mistral": 2 layers, every one sliding;
- "qwen2": 3 layers, max_window_layers=1: layer 0 full, layers 1-2 sliding;
- "gemma2": 3 layers (sliding, full, sliding), query_pre_attn_scalar 24 (not head_dim, so the scale shows),
  attention scores soft-capped at 10 and logits at 3 (both bite at these sizes), tied embeddings;
- "gemma3": 3 layers (sliding, full, sliding), q/k norms, a local rotary base of 1000 for the sliding layers and
  a global base of 50000 with linear scaling x2 for the full one, final logits soft-capped at 3;
- "mixtral": tests/tiny_moe_models.py's Mixtral (2 layers, 8 experts, top-2), every layer sliding;
- "qwen3": 3 layers with q/k norms, max_window_layers=1: layer 0 full, layers 1-2 sliding;
- "qwen3_moe": tests/tiny_moe_models.py's Qwen3-MoE (layer 0 sparse, layer 1 dense), every layer sliding (its
  transformers config reads no max_window_layers).
"""

from __future__ import annotations

import os
from typing import Any

import gguf
import torch

from tiny_gpt_oss import save_tiny_gpt_oss
from tiny_models import TINY_CHAT_TEMPLATE, randomize_weights, tiny_hf_tokenizer, tiny_vocab
from tiny_moe_models import make_tiny_moe_model, tiny_moe_config

WINDOW = 8
"""The tiny models' sliding window: the tests' prompts are 3-6 times as long."""

_FAMILY_FIELDS: dict[str, dict[str, Any]] = {
    "mistral": dict(num_hidden_layers=2, sliding_window=WINDOW, rope_theta=50000.0),
    "qwen2": dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                  rope_theta=50000.0),
    "gemma2": dict(num_hidden_layers=3, sliding_window=WINDOW, query_pre_attn_scalar=24,
                   attn_logit_softcapping=10.0, final_logit_softcapping=3.0, rope_theta=50000.0),
    "gemma3": dict(num_hidden_layers=3, sliding_window=WINDOW, query_pre_attn_scalar=24,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                   final_logit_softcapping=3.0,
                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}}),
    "mixtral": dict(sliding_window=WINDOW),
    "qwen3": dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    "qwen3_moe": dict(use_sliding_window=True, sliding_window=WINDOW),
}
_MOE_BUILT = ("mixtral", "qwen3", "qwen3_moe")
"""Families built by tests/tiny_moe_models.py (its shapes, routing sharpened) with the window fields above."""
FAMILIES = tuple(_FAMILY_FIELDS)
"""Short names the builders take."""


def window_hf_config(family: str, **overrides: Any):
    """The transformers config of `family` at the tiny shape, with `overrides` applied."""
    from transformers import Gemma2Config, Gemma3TextConfig, MistralConfig, Qwen2Config

    if family in _MOE_BUILT:
        return tiny_moe_config(family, **{**_FAMILY_FIELDS[family], **overrides})
    classes = {"mistral": MistralConfig, "qwen2": Qwen2Config, "gemma2": Gemma2Config, "gemma3": Gemma3TextConfig}
    if family not in classes:
        raise ValueError(f"unknown tiny family {family!r}; choose one of {FAMILIES}")
    vocab = tiny_vocab()
    fields: dict[str, Any] = dict(
        vocab_size=len(vocab.tokens), hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5,
        bos_token_id=vocab.bos_token_id, eos_token_id=vocab.eos_token_id, pad_token_id=vocab.pad_token_id,
    )
    fields.update(_FAMILY_FIELDS[family])
    fields.update(overrides)
    return classes[family](**fields)


def make_tiny_window_model(family: str, *, seed: int = 0, **overrides: Any):
    """A random transformers model of `family` (float32, eval mode, eager attention)."""
    from transformers import AutoModelForCausalLM

    if family in _MOE_BUILT:
        model = make_tiny_moe_model(family, seed=seed, **{**_FAMILY_FIELDS[family], **overrides})
        model.config._attn_implementation = "eager"
        return model
    torch.manual_seed(seed)
    config = window_hf_config(family, **overrides)
    config._attn_implementation = "eager"  # the reference computes every score (Gemma2 refuses SDPA anyway)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return randomize_weights(model, seed)


def save_tiny_window_model(folder: str, family: str, *, seed: int = 0, **overrides: Any) -> str:
    """Write the random tiny model of `family` as a Hugging Face folder (with the tiny tokenizer); returns it."""
    os.makedirs(folder, exist_ok=True)
    make_tiny_window_model(family, seed=seed, **overrides).save_pretrained(folder)
    tiny_hf_tokenizer().save_pretrained(folder)
    return folder


def save_window_family(folder: str, family: str, *, seed: int = 0, **overrides: Any) -> str:
    """`save_tiny_window_model`, or for "gpt_oss" tests/tiny_gpt_oss.py's model with a window of WINDOW."""
    if family == "gpt_oss":
        return save_tiny_gpt_oss(folder, seed=seed, sliding_window=WINDOW, **overrides)
    return save_tiny_window_model(folder, family, seed=seed, **overrides)


_GEMMA_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
}  # fmt: skip


def _gemma_gguf_name(hf_name: str) -> str:
    globals_ = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if hf_name in globals_:
        return globals_[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)  # model.layers.{i}.{module}.weight
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_GEMMA_GGUF_NAMES[module]}.{kind}"


def write_tiny_gemma_gguf(path: str, model) -> None:
    """`model` (a tiny Gemma2ForCausalLM / Gemma3ForCausalLM, tied) as a GGUF file the way llama.cpp's converter
    writes one: its names, 1 + w for every norm, rope scaling and the sliding window in the metadata. llama.cpp
    keeps no query_pre_attn_scalar (it uses head_dim) and no layer pattern for Gemma 3 (five sliding of six), so
    the model must have those."""
    config = model.config
    arch = {"gemma2": "gemma2", "gemma3_text": "gemma3"}[config.model_type]
    vocab = tiny_vocab()
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_sliding_window(config.sliding_window)
    rope = config.rope_parameters.get("full_attention", config.rope_parameters)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    if rope.get("rope_type", "default") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
    if config.final_logit_softcapping is not None:
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    writer.add_vocab_size(config.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(list(vocab.tokens))
    writer.add_token_types(list(vocab.token_types))
    writer.add_token_merges(list(vocab.merges))
    writer.add_bos_token_id(vocab.bos_token_id)
    writer.add_eos_token_id(vocab.eos_token_id)
    writer.add_pad_token_id(vocab.pad_token_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template(TINY_CHAT_TEMPLATE)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied: llama.cpp writes no output.weight
        weight = tensor.detach().to(torch.float32)
        if name.endswith("norm.weight"):
            weight = weight + 1  # llama.cpp's RMSNorm multiplies by the stored weight
        writer.add_tensor(_gemma_gguf_name(name), weight.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
