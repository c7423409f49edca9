"""Tiny random GPT-OSS models for tests (built with transformers' GptOssConfig, nothing downloaded).

Same vocabulary and tokenizer as tests/tiny_models.py, attention sharpened the same way. Shapes: hidden 64, 4 query
heads and 2 KV heads of width 16, 2 layers (sliding, then full: GptOssConfig's default `layer_types`), 8 experts of
width 32, top-2. What the family adds is made to matter on these shapes:
- the attention sinks are drawn from N(0, 2^2), so a sink takes a visible share of a head's softmax;
- the expert weights are drawn large enough (std 0.15) and `swiglu_limit` lowered to 1.5, so both clamps of the
  SwiGLU fire on a good share of the rows;
- router weights are scaled like tests/tiny_moe_models.py's (ROUTER_SCALE), and its bias randomized, so the top-k
  choices win by clear margins and rounding differences between layouts never flip one.

`save_mxfp4_folder` writes the same model with its experts in the released checkpoints' MXFP4 form
(`*_blocks` / `*_scales`, quantized by cpllm/model/formats/mxfp4.py), and returns the weights those blocks dequantize to,
so a test can run transformers on exactly what the engine should load.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from tiny_models import randomize_weights, tiny_hf_tokenizer, tiny_vocab
from tiny_moe_models import ROUTER_SCALE

EXPERT_STD = 0.15
"""Std of the random expert weights: gate/up values of a few units, against SWIGLU_LIMIT."""
SWIGLU_LIMIT = 1.5
"""Lowered from the released 7.0 so the clamps fire on the tiny model's activations."""
YARN = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 64, "rope_theta": 150000.0}
"""The released models' rope kind (YaRN, untruncated), scaled down to the tiny context."""
EXPERT_TENSORS = ("gate_up_proj", "down_proj")


def tiny_gpt_oss_config(**overrides: Any):
    from transformers import GptOssConfig

    vocab = tiny_vocab()
    fields: dict[str, Any] = dict(
        vocab_size=len(vocab.tokens), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=256, rms_norm_eps=1e-5, sliding_window=128, swiglu_limit=SWIGLU_LIMIT,
        rope_parameters=dict(YARN), tie_word_embeddings=False, bos_token_id=vocab.bos_token_id,
        eos_token_id=vocab.eos_token_id, pad_token_id=vocab.pad_token_id,
    )  # fmt: skip
    fields.update(overrides)
    config = GptOssConfig(**fields)
    config._attn_implementation = "eager"  # the reference math (sinks in the softmax denominator)
    return config


def _randomize(name: str, param: torch.Tensor, generator: torch.Generator) -> None:
    if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
        param.copy_(EXPERT_STD * torch.randn(param.shape, generator=generator))
    elif name.endswith(("experts.gate_up_proj_bias", "experts.down_proj_bias")):
        param.copy_(0.1 * torch.randn(param.shape, generator=generator))
    elif name.endswith("mlp.router.weight"):
        param.copy_(0.02 * ROUTER_SCALE * torch.randn(param.shape, generator=generator))
    elif name.endswith("self_attn.sinks"):
        param.copy_(2.0 * torch.randn(param.shape, generator=generator))


def make_tiny_gpt_oss(*, seed: int = 0, **overrides: Any):
    """A random transformers GptOssForCausalLM (float32, eval, eager attention)."""
    from transformers import GptOssForCausalLM

    torch.manual_seed(seed)
    model = GptOssForCausalLM(tiny_gpt_oss_config(**overrides)).to(torch.float32)
    return randomize_weights(model, seed, _randomize)


def save_tiny_gpt_oss(folder: str, *, seed: int = 0, **overrides: Any) -> str:
    """The model as a Hugging Face folder (experts as float tensors, as save_pretrained writes them) + tokenizer."""
    os.makedirs(folder, exist_ok=True)
    make_tiny_gpt_oss(seed=seed, **overrides).save_pretrained(folder)
    tiny_hf_tokenizer().save_pretrained(folder)
    return folder


def save_mxfp4_folder(folder: str, *, seed: int = 0, **overrides: Any) -> dict[str, torch.Tensor]:
    """The model with every expert weight MXFP4-packed as the released checkpoints store it:
    `...experts.gate_up_proj_blocks` [E, 2I, hidden / 32, 16] uint8 and `..._scales` [E, 2I, hidden / 32] uint8
    (likewise down_proj over I), with a `quantization_config` of quant_method "mxfp4" in config.json.
    Returns {float tensor name: the [E, in, out] weight the blocks dequantize to}."""
    from safetensors.torch import load_file, save_file

    from cpllm.model.formats.mxfp4 import dequantize_mxfp4, quantize_mxfp4

    save_tiny_gpt_oss(folder, seed=seed, **overrides)
    path = os.path.join(folder, "model.safetensors")
    state, packed, dequantized = load_file(path), {}, {}
    for name, tensor in state.items():
        if name.rsplit(".", 1)[-1] not in EXPERT_TENSORS:
            packed[name] = tensor
            continue
        blocks, scales = quantize_mxfp4(tensor.transpose(1, 2))  # HF [E, in, out] -> stored [E, out, in]
        packed[f"{name}_blocks"], packed[f"{name}_scales"] = blocks, scales
        dequantized[name] = dequantize_mxfp4(blocks, scales).transpose(1, 2).contiguous()
    save_file(packed, path, metadata={"format": "pt"})
    config_path = os.path.join(folder, "config.json")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                     "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    return dequantized


def load_dequantized_reference(dequantized: dict[str, torch.Tensor], *, seed: int = 0, **overrides: Any):
    """The transformers model of `make_tiny_gpt_oss(seed, **overrides)` with its expert weights replaced by
    `dequantized` (save_mxfp4_folder's return): the reference for an MXFP4 folder."""
    model = make_tiny_gpt_oss(seed=seed, **overrides)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, weight in dequantized.items():
            params[name].copy_(weight)
    return model
