"""Tiny random gated-DeltaNet hybrids for tests (built with transformers, nothing downloaded): Qwen3.5 dense,
Qwen3.5-MoE and Qwen3-Next.

Same vocabulary and tokenizer as tests/tiny_models.py. Shapes: hidden 64, 8 layers in the 3 : 1 pattern (layers 3
and 7 full attention: 4 query heads and 2 KV heads of width 16, rotary on half of each head); DeltaNet layers with
2 key heads and 4 value heads of width 16 (each key head serves two value heads) and a 4-tap convolution. MoE
cases: 8 experts of width 32, top 2, a shared expert of width 48 behind its sigmoid gate.

Every weight is drawn from one seeded generator: every norm's factor 1 + N(0, 0.1) (the (1 + w) norms store w),
other weights N(0, 0.05) (small enough that float32 rounding stays near 1e-6 in the logprobs),
attention sharpened (q/k projections x 4), the LM head x 3, the decays spread (A_log = log U(0.5, 8), dt_bias N(0, 0.5)) so
some heads forget within a few tokens and others keep their state over the whole prompt.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from tiny_models import tiny_hf_tokenizer, tiny_vocab

CASES = {
    "qwen3_5": dict(),
    "qwen3_5_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                        shared_expert_intermediate_size=48),
    "qwen3_next": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=48, norm_topk_prob=True, decoder_sparse_step=1),
}
"""Family (transformers model type) -> config overrides."""
ROUTER_STD = 2.0
WEIGHT_STD = 0.05


def tiny_hybrid_config(family: str, **overrides: Any):
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3NextConfig

    vocab = tiny_vocab()
    fields: dict[str, Any] = dict(
        vocab_size=len(vocab.tokens), hidden_size=64, intermediate_size=96, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, max_position_embeddings=512,
        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=vocab.bos_token_id,
        eos_token_id=vocab.eos_token_id, pad_token_id=vocab.pad_token_id,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    )  # fmt: skip
    fields.update(CASES[family])
    fields.update(overrides)
    classes = {"qwen3_5": Qwen3_5TextConfig, "qwen3_5_moe": Qwen3_5MoeTextConfig, "qwen3_next": Qwen3NextConfig}
    return classes[family](**fields)


def make_tiny_hybrid(family: str, *, seed: int = 0, **overrides: Any):
    """transformers' model of the family (float32, eval), every weight drawn from one seeded generator."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_hybrid_config(family, **overrides), dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):  # the gated norm scales by w
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            elif name.endswith("norm.weight"):  # the others by 1 + w
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
            elif name.endswith("A_log"):
                param.copy_(torch.empty(param.shape).uniform_(math.log(0.5), math.log(8.0), generator=gen))
            elif name.endswith("dt_bias"):
                param.copy_(0.5 * torch.randn(param.shape, generator=gen))
            elif name.endswith("gate.weight") and "shared_expert_gate" not in name:
                param.copy_(ROUTER_STD * torch.randn(param.shape, generator=gen))  # router: clear expert choices
            else:
                param.copy_(WEIGHT_STD * torch.randn(param.shape, generator=gen))
            if name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
                param.mul_(4.0)
            if name == "lm_head.weight":
                param.mul_(3.0)  # peaked next-token distributions: greedy choices by clear margins
    return model.eval()


def save_tiny_hybrid(folder: str, family: str, *, seed: int = 0, **overrides: Any) -> str:
    """The family's model as a Hugging Face folder (as save_pretrained writes it) + the tiny tokenizer."""
    os.makedirs(folder, exist_ok=True)
    make_tiny_hybrid(family, seed=seed, **overrides).save_pretrained(folder)
    tiny_hf_tokenizer().save_pretrained(folder)
    return folder
