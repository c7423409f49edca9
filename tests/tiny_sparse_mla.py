"""Tiny random DeepSeek-V3.2 and GLM-5 models (DeepSeek sparse attention) for tests, built with transformers.

The MLA shapes of tests/tiny_deepseek.py (hidden 64, 4 heads, kv_lora_rank 32, rope 16, nope 16, v 24,
q_lora_rank 24; 3 layers, the first dense; 8 routed experts of width 32, top-2, shared experts) plus an indexer of
16 heads of width 32 selecting `index_topk` = 8 tokens: prompts longer than 8 tokens select, shorter ones attend
densely. Sixteen index heads make an exact ReLU tie (every head negative for two keys) rare enough never to reach
the cut in these tests' prompts; weights as in tiny_deepseek (sharp attention and routing).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from tiny_deepseek import ATTENTION_STD, BIAS_STD, EXPERT_STD
from tiny_models import tiny_hf_tokenizer, tiny_vocab

INDEX_TOPK = 8
CASES = {
    # DeepSeek-V3.2: V3's grouped noaux_tc router, YaRN off, half-split index rotary
    "v32": ("v32", dict(n_group=4, topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1)),
    # GLM-5: one group, interleaved index rotary, mlp_layer_types
    "glm5": ("glm5", dict(n_group=1, topk_group=1, routed_scaling_factor=1.8,
                          mlp_layer_types=["dense", "sparse", "sparse"])),
}
"""Name -> (family, config overrides)."""
ROUTER_STD = 0.25


def tiny_sparse_config(family: str, **overrides: Any):
    from transformers import DeepseekV32Config, GlmMoeDsaConfig

    vocab = tiny_vocab()
    fields: dict[str, Any] = dict(
        vocab_size=len(vocab.tokens), hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
        num_experts_per_tok=2, kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=16, qk_nope_head_dim=16,
        v_head_dim=24, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
        index_topk=INDEX_TOPK, index_head_dim=32, index_n_heads=16, norm_topk_prob=True,
        bos_token_id=vocab.bos_token_id, eos_token_id=vocab.eos_token_id, pad_token_id=vocab.pad_token_id,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )  # fmt: skip
    fields.update(overrides)
    return {"v32": DeepseekV32Config, "glm5": GlmMoeDsaConfig}[family](**fields)


def make_tiny_sparse(case: str, *, seed: int = 0, **overrides: Any):
    """transformers' model of the case (float32, eval), every weight drawn from one seeded generator."""
    from transformers import AutoModelForCausalLM

    family, fields = CASES[case]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_sparse_config(family, **{**fields, **overrides}),
                                             dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            elif ".self_attn." in name:
                param.copy_(ATTENTION_STD * torch.randn(param.shape, generator=gen))
            elif name.endswith("mlp.gate.weight"):
                param.copy_(ROUTER_STD * torch.randn(param.shape, generator=gen))
            elif ".experts." in name or name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                param.copy_(EXPERT_STD * torch.randn(param.shape, generator=gen))
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("e_score_correction_bias"):
                tensor.copy_(BIAS_STD * torch.randn(tensor.shape, generator=gen))
    return model.eval()


def save_tiny_sparse(folder: str, case: str, *, seed: int = 0, **overrides: Any) -> str:
    """The case's model as a Hugging Face folder + the tiny tokenizer."""
    os.makedirs(folder, exist_ok=True)
    make_tiny_sparse(case, seed=seed, **overrides).save_pretrained(folder)
    tiny_hf_tokenizer().save_pretrained(folder)
    return folder
