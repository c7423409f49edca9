"""Tiny random models of the families with sliding-window or hybrid attention, built on the spot with
transformers 5 configs (nothing is downloaded): Mistral, Qwen2 with `use_sliding_window`, Gemma2, Gemma3 (text).

- `window_hf_config(family, **overrides)`: the transformers config;
- `make_tiny_window_model(family, seed=, **overrides)`: the random transformers model (float32, eval), weights
  randomized as tests/tiny_models.py does (norms, biases, sharpened q/k);
- `save_tiny_window_model(folder, family, seed=, **overrides)`: the same model as a Hugging Face folder with the
  tiny tokenizer.

Shapes are tests/tiny_models.py's (vocab 300, hidden 64, 4 heads of 16, 2 KV heads, MLP 128, 256 positions)
with a window of WINDOW tokens, so prompts a few times the window reach keys that have left it:
- "mistral": 2 layers, every one sliding;
- "qwen2": 3 layers, max_window_layers=1: layer 0 full, layers 1-2 sliding;
- "gemma2": 3 layers (sliding, full, sliding), query_pre_attn_scalar 24 (not head_dim, so the scale shows),
  attention scores soft-capped at 10 and logits at 3 (both bite at these sizes), tied embeddings;
- "gemma3": 3 layers (sliding, full, sliding), q/k norms, a local rotary base of 1000 for the sliding layers and
  a global base of 50000 with linear scaling x2 for the full one, final logits soft-capped at 3.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from tiny_models import randomize_weights, tiny_hf_tokenizer, tiny_vocab

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
}
FAMILIES = tuple(_FAMILY_FIELDS)
"""Short names the builders take."""


def window_hf_config(family: str, **overrides: Any):
    """The transformers config of `family` at the tiny shape, with `overrides` applied."""
    from transformers import Gemma2Config, Gemma3TextConfig, MistralConfig, Qwen2Config

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
