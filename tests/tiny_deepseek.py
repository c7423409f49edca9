"""Tiny random DeepSeek-V2 / DeepSeek-V3 / GLM-4.7-Flash models for tests (built with transformers, nothing downloaded).

Same vocabulary and tokenizer as tests/tiny_models.py. Shapes: hidden 64, 4 heads, kv_lora_rank 32, rope 16,
nope 16, v_head_dim 24 (v differs from nope + rope), 3 layers of which the first is dense (intermediate 96),
8 routed experts of width 32 (top-2; n_group 4 where a case limits groups) and shared experts. Expert width 32
splits over 4 ranks (expert-TP), 8 experts over 4 ranks (EP), 4 heads over TP = 2 or 4.

Attention is sharpened (MLA weights of std 0.3: peaked attention, a wrong key or position shows) and so is
routing: V2's softmax router weights of std 0.8 (logits of std ~6), V3 / GLM sigmoid router weights of std 0.25
and a correction bias of std 0.15 that changes some choices, so each token's experts win by clear margins and
float32 rounding between implementations or layouts never flips a choice.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from tiny_models import tiny_hf_tokenizer, tiny_vocab

ARCHITECTURES = {"v2": "DeepseekV2ForCausalLM", "v3": "DeepseekV3ForCausalLM", "glm": "Glm4MoeLiteForCausalLM"}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 0.9,
        "mscale_all_dim": 0.7, "beta_fast": 32, "beta_slow": 1}
CASES = {
    # V2: queries direct, greedy softmax top-k, two shared experts
    "v2": ("v2", dict(q_lora_rank=None, topk_method="greedy", n_shared_experts=2, routed_scaling_factor=1.0)),
    # V2 (V2.5-like): queries through q_lora_rank, group-limited top-k, YaRN with mscale_all_dim
    "v2-lora-groups-yarn": ("v2", dict(q_lora_rank=24, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                       routed_scaling_factor=4.0, n_shared_experts=1,
                                       rope_parameters={**YARN, "rope_theta": 10000.0})),
    # V3 / R1: q_lora_rank, noaux_tc over groups, renormalised, YaRN, interleaved rope
    "v3-yarn": ("v3", dict(q_lora_rank=24, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
                           rope_interleave=True, rope_parameters={**YARN, "rope_theta": 10000.0})),
    # Kimi-K2-like: one group, no q_lora, rope halves
    "v3-direct": ("v3", dict(q_lora_rank=None, n_group=1, topk_group=1, norm_topk_prob=True,
                             routed_scaling_factor=2.827, rope_interleave=False)),
    # GLM-4.7-Flash: mlp_layer_types, q_lora_rank
    "glm": ("glm", dict(q_lora_rank=24, n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.8,
                        mlp_layer_types=["dense", "sparse", "sparse"])),
}
"""Name -> (family, config overrides): every router kind, q_lora_rank set and unset, YaRN on and off."""
ROUTER_STD = {"v2": 0.8, "v3": 0.25, "glm": 0.25}
BIAS_STD = 0.15
ATTENTION_STD = 0.3
EXPERT_STD = 0.05


def tiny_deepseek_config(family: str, **overrides: Any):
    from transformers import DeepseekV2Config, DeepseekV3Config, Glm4MoeLiteConfig

    vocab = tiny_vocab()
    fields: dict[str, Any] = dict(
        vocab_size=len(vocab.tokens), hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
        num_experts_per_tok=2, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24,
        max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=vocab.bos_token_id, eos_token_id=vocab.eos_token_id, pad_token_id=vocab.pad_token_id,
    )  # fmt: skip
    if family in ("v2", "v3"):
        fields["first_k_dense_replace"] = 1
    fields.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0})
    fields.update(overrides)
    classes = {"v2": DeepseekV2Config, "v3": DeepseekV3Config, "glm": Glm4MoeLiteConfig}
    return classes[family](**fields)


def make_tiny_deepseek(case: str, *, seed: int = 0):
    """transformers' model of the case (float32, eval), every weight drawn from one seeded generator."""
    from transformers import AutoModelForCausalLM

    family, overrides = CASES[case]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_deepseek_config(family, **overrides), dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            elif ".self_attn." in name:
                param.copy_(ATTENTION_STD * torch.randn(param.shape, generator=gen))
            elif name.endswith("mlp.gate.weight"):
                param.copy_(ROUTER_STD[family] * torch.randn(param.shape, generator=gen))
            elif ".experts." in name or name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                param.copy_(EXPERT_STD * torch.randn(param.shape, generator=gen))
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("e_score_correction_bias"):  # HF starts it at zeros
                tensor.copy_(BIAS_STD * torch.randn(tensor.shape, generator=gen))
    return model.eval()


def save_tiny_deepseek(folder: str, case: str, *, seed: int = 0) -> str:
    """The case's model as a Hugging Face folder (as save_pretrained writes it) + the tiny tokenizer."""
    os.makedirs(folder, exist_ok=True)
    make_tiny_deepseek(case, seed=seed).save_pretrained(folder)
    tiny_hf_tokenizer().save_pretrained(folder)
    return folder
