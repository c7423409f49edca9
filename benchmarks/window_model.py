"""A random model of Gemma 3 1B's text shape, and the same weights with every layer global, as Hugging Face folders
(issue 31's benchmark; benchmarks/window_bench.py measures them).

Gemma 3 1B: 26 layers, five sliding (window 512) per full one, hidden 1152, 4 query heads and 1 KV head of 256,
GeGLU MLP of 6912, vocabulary 262144, local rotary base 10000 and global base 1e6. `--layers` and `--vocab` cut
the depth (layer i is full when (i + 1) % 6 == 0, as released) and the vocabulary; everything else is kept. Nothing is
downloaded: transformers' Gemma3TextConfig with random weights (N(0, 0.02), norms 0 as Gemma stores them, so that
the (1 + w) factor is 1), saved once as safetensors with the tests' tiny tokenizer (prompts are random ids).
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))  # the tiny tokenizer

GEMMA3_1B = dict(hidden_size=1152, intermediate_size=6912, num_attention_heads=4, num_key_value_heads=1,
                 head_dim=256, query_pre_attn_scalar=256, sliding_window=512, rms_norm_eps=1e-6)
"""The released model's text config fields the benchmark keeps as they are."""

TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
            query_pre_attn_scalar=16, sliding_window=16, rms_norm_eps=1e-6)
"""A tiny shape of the same kinds (one KV head, five sliding layers per full one), for the smoke test."""

SHAPES = {"gemma3-1b": GEMMA3_1B, "tiny": TINY}


def gemma3_config(layers: int, vocab: int, max_positions: int, all_global: bool = False,
                  shape: str = "gemma3-1b"):
    """Gemma3TextConfig of the `shape` (SHAPES) with `layers` layers (layer i full when (i + 1) % 6 == 0, the
    released pattern) or, with `all_global`, every layer full."""
    from tiny_models import tiny_vocab
    from transformers import Gemma3TextConfig

    if layers < 6:
        raise ValueError(f"--layers {layers} holds no full layer of Gemma 3's 5 : 1 pattern; give 6 or more")
    ids = tiny_vocab()
    types = ["full_attention" if all_global or (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)]
    return Gemma3TextConfig(
        vocab_size=vocab, num_hidden_layers=layers, layer_types=types, max_position_embeddings=max_positions,
        bos_token_id=ids.bos_token_id, eos_token_id=ids.eos_token_id, pad_token_id=ids.pad_token_id,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        tie_word_embeddings=True, **SHAPES[shape])


def build_folders(cache: str, layers: int, vocab: int, max_positions: int,
                  shape: str = "gemma3-1b") -> tuple[str, str]:
    """(hybrid folder, all-global folder), written once and reused; the all-global one holds a copy of the
    hybrid's config with every layer full and a link to the same safetensors."""
    from tiny_models import tiny_hf_tokenizer
    from transformers import AutoModelForCausalLM

    name = f"{shape}-shape-l{layers}-v{vocab}-p{max_positions}"
    hybrid, full = os.path.join(cache, name), os.path.join(cache, name + "-all-global")
    if not os.path.exists(os.path.join(hybrid, "config.json")):
        torch.manual_seed(0)
        config = gemma3_config(layers, vocab, max_positions, shape=shape)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if param_name.endswith("norm.weight"):
                    param.zero_()
                else:
                    param.normal_(0.0, 0.02)
        model.save_pretrained(hybrid)
        tiny_hf_tokenizer().save_pretrained(hybrid)
    if not os.path.exists(os.path.join(full, "config.json")):
        os.makedirs(full, exist_ok=True)
        for entry in os.listdir(hybrid):
            if entry == "config.json":
                continue
            target = os.path.join(full, entry)
            if not os.path.exists(target):
                if entry.endswith(".safetensors"):
                    os.symlink(os.path.join(hybrid, entry), target)
                else:
                    shutil.copy(os.path.join(hybrid, entry), target)
        with open(os.path.join(hybrid, "config.json")) as f:
            config = json.load(f)
        config["layer_types"] = ["full_attention"] * layers
        with open(os.path.join(full, "config.json"), "w") as f:
            json.dump(config, f, indent=1)
    return hybrid, full
