"""Tiny random Kimi Linear models for tests (built with transformers, nothing downloaded).

Same vocabulary and tokenizer as tests/tiny_models.py. Shapes: hidden 64, 4 layers: Kimi delta attention at 0, 1
and 3 (4 heads of width 16, a 4-tap convolution), MLA at 2 (4 heads, kv_lora_rank 32, rope part 8, nope 16,
v_head_dim 24, no rotary); layer 0 dense (intermediate 96), the others the DeepSeek MoE (8 experts of width 32,
top 2 of the best of 2 groups, one shared expert). 4 heads split over TP = 2.

Every weight is drawn from one seeded generator: norms 1 + N(0, 0.1); MLA weights of std 0.3 (peaked attention);
the convolutions N(0, 0.3); the KDA decays spread (A_log = log U(0.3, 4), dt_bias N(-1.5, 1.5)) so some channels
forget within a few tokens and others keep their state over the whole prompt; sigmoid router weights of std 0.25
and a correction bias of std 0.15 (clear expert choices); other weights N(0, 0.05), the LM head x 3.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from tiny_models import tiny_hf_tokenizer, tiny_vocab

LAYER_TYPES = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]
WEIGHT_STD = 0.05
MLA_STD = 0.3


def tiny_kimi_config(**overrides: Any):
    from transformers import KimiLinearConfig

    vocab = tiny_vocab()
    fields: dict[str, Any] = dict(
        vocab_size=len(vocab.tokens), hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=24, q_lora_rank=None, linear_head_dim=16, linear_num_heads=4,
        linear_conv_kernel_dim=4, num_local_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
        n_shared_experts=1, routed_scaling_factor=2.446, norm_topk_prob=True, layer_types=list(LAYER_TYPES),
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"], max_position_embeddings=512, rms_norm_eps=1e-5,
        tie_word_embeddings=False, bos_token_id=vocab.bos_token_id, eos_token_id=vocab.eos_token_id,
        pad_token_id=vocab.pad_token_id,
    )  # fmt: skip
    fields.update(overrides)
    return KimiLinearConfig(**fields)


def _draw(name: str, shape, gen: torch.Generator) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    if name.endswith("A_log"):
        return torch.empty(shape).uniform_(math.log(0.3), math.log(4.0), generator=gen)
    if name.endswith("dt_bias"):
        return -1.5 + 1.5 * torch.randn(shape, generator=gen)
    if name.endswith("conv1d.weight"):
        return 0.3 * torch.randn(shape, generator=gen)
    if name.endswith("mlp.gate.weight"):
        return 0.25 * torch.randn(shape, generator=gen)
    if name.endswith("e_score_correction_bias"):
        return 0.15 * torch.randn(shape, generator=gen)
    return WEIGHT_STD * torch.randn(shape, generator=gen)


def make_tiny_kimi(*, seed: int = 0, **overrides: Any):
    """transformers' Kimi Linear model (float32, eval), every weight drawn from one seeded generator."""
    from transformers import AutoModelForCausalLM

    config = tiny_kimi_config(**overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    full = {i for i, kind in enumerate(config.layer_types) if kind == "full_attention"}
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if not tensor.is_floating_point():
                continue
            mla = name.startswith("model.layers.") and int(name.split(".")[2]) in full and ".self_attn." in name
            if mla and not name.endswith("norm.weight"):
                tensor.copy_(MLA_STD * torch.randn(tensor.shape, generator=gen))
            else:
                tensor.copy_(_draw(name, tensor.shape, gen))
            if name == "lm_head.weight":
                tensor.mul_(3.0)  # peaked next-token distributions: greedy choices by clear margins
    return model.eval()


def save_tiny_kimi(folder: str, *, seed: int = 0, **overrides: Any) -> str:
    """The model as a Hugging Face folder (as save_pretrained writes it: the original checkpoint's names,
    q/k/v_conv1d apart, block_sparse_moe with w1/w2/w3 experts) + the tiny tokenizer."""
    os.makedirs(folder, exist_ok=True)
    make_tiny_kimi(seed=seed, **overrides).save_pretrained(folder)
    tiny_hf_tokenizer().save_pretrained(folder)
    return folder


@torch.no_grad()
def hf_greedy_cached(model, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], list[float], list[float]]:
    """As reference.hf_greedy (tokens, their logprobs, prompt logprobs of positions 1..), but one prompt forward and
    then one token per forward through transformers' cache (its recurrent KDA step and its MLA cache): the full
    re-forwards of hf_greedy run transformers' per-token Python loop of the chunked KDA each time, minutes here."""
    out = model(torch.tensor([prompt_ids]), use_cache=True)
    cache = out.cache
    lp = torch.log_softmax(out.logits[0].double(), dim=-1)
    prompt_lp = [lp[i, prompt_ids[i + 1]].item() for i in range(len(prompt_ids) - 1)]
    tokens, logprobs = [], []
    for step in range(max_tokens):
        token = int(lp[-1].argmax())
        tokens.append(token)
        logprobs.append(lp[-1, token].item())
        if step + 1 < max_tokens:
            out = model(torch.tensor([[token]]), cache=cache, use_cache=True)
            cache = out.cache
            lp = torch.log_softmax(out.logits[0].double(), dim=-1)
    return tokens, logprobs, prompt_lp
