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

    family, overrides = {**CASES, **GGUF_CASES}[case]
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


GGUF_CASES = {
    # YaRN with mscale = mscale_all_dim: what a deepseek2 GGUF file can say (it keeps no separate mscale)
    "v3-yarn-gguf": ("v3", dict(q_lora_rank=24, n_group=4, topk_group=2, norm_topk_prob=True,
                                routed_scaling_factor=2.5, rope_interleave=True,
                                rope_parameters={**YARN, "mscale": 0.7, "rope_theta": 10000.0})),
}
"""Cases only the GGUF test builds (make_tiny_deepseek and save_tiny_deepseek take them too)."""
CASES_ALL = {**CASES, **GGUF_CASES}

_GGUF_ATTN = {"q_proj": "attn_q", "q_a_proj": "attn_q_a", "q_a_layernorm": "attn_q_a_norm", "q_b_proj": "attn_q_b",
              "kv_a_proj_with_mqa": "attn_kv_a_mqa", "kv_a_layernorm": "attn_kv_a_norm", "o_proj": "attn_output",
              "kv_b_proj": "attn_kv_b"}
_GGUF_MLP = {"gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


def _gguf_layer_name(rest: str) -> str:
    """llama.cpp's deepseek2 name of a layer tensor (after `model.layers.N.`), experts excepted."""
    module, kind = rest.rsplit(".", 1)
    if module == "input_layernorm":
        return f"attn_norm.{kind}"
    if module == "post_attention_layernorm":
        return f"ffn_norm.{kind}"
    if module.startswith("self_attn."):
        return f"{_GGUF_ATTN[module.split('.', 1)[1]]}.{kind}"
    if module == "mlp.gate":
        return "exp_probs_b.bias" if kind == "e_score_correction_bias" else "ffn_gate_inp.weight"
    if module.startswith("mlp.shared_experts."):
        return f"{_GGUF_MLP[module.rsplit('.', 1)[1]]}_shexp.{kind}"
    return f"{_GGUF_MLP[module.split('.', 1)[1]]}.{kind}"  # a dense layer's MLP


def save_tiny_deepseek_gguf(path: str, folder: str, case: str, *, split_kv_b: bool = True) -> None:
    """The folder's weights (F32) as llama.cpp's converter lays out a deepseek2 file: experts stacked per
    projection, kv_b_proj split into attn_k_b [H, r, nope] (the key rows transposed) and attn_v_b [H, v, r]
    (or whole as attn_kv_b with `split_kv_b=False`, as older files have it), the MLA widths and the router in
    the metadata."""
    import gguf
    import numpy as np
    from safetensors.torch import load_file

    family, overrides = CASES_ALL[case]
    config, vocab = tiny_deepseek_config(family, **overrides), tiny_vocab()
    writer = gguf.GGUFWriter(path, "deepseek2")
    for add, value in [(writer.add_block_count, config.num_hidden_layers),
                       (writer.add_context_length, config.max_position_embeddings),
                       (writer.add_embedding_length, config.hidden_size),
                       (writer.add_feed_forward_length, config.intermediate_size),
                       (writer.add_head_count, config.num_attention_heads), (writer.add_head_count_kv, 1),
                       (writer.add_rope_freq_base, float(config.rope_parameters["rope_theta"])),
                       (writer.add_layer_norm_rms_eps, config.rms_norm_eps),
                       (writer.add_rope_dimension_count, config.qk_rope_head_dim),
                       (writer.add_kv_lora_rank, config.kv_lora_rank),
                       (writer.add_key_length, config.kv_lora_rank + config.qk_rope_head_dim),
                       (writer.add_value_length, config.kv_lora_rank),
                       (writer.add_key_length_mla, config.qk_nope_head_dim + config.qk_rope_head_dim),
                       (writer.add_value_length_mla, config.v_head_dim),
                       (writer.add_leading_dense_block_count, config.first_k_dense_replace),
                       (writer.add_expert_count, config.n_routed_experts),
                       (writer.add_expert_used_count, config.num_experts_per_tok),
                       (writer.add_expert_shared_count, config.n_shared_experts),
                       (writer.add_expert_feed_forward_length, config.moe_intermediate_size),
                       (writer.add_expert_weights_scale, float(config.routed_scaling_factor)),
                       (writer.add_expert_weights_norm, bool(config.norm_topk_prob)),
                       (writer.add_expert_group_count, config.n_group or 1),
                       (writer.add_expert_group_used_count, config.topk_group or 1),
                       (writer.add_vocab_size, config.vocab_size)]:
        add(value)
    if config.q_lora_rank:
        writer.add_q_lora_rank(config.q_lora_rank)
    gating = gguf.ExpertGatingFuncType.SOFTMAX if family == "v2" else gguf.ExpertGatingFuncType.SIGMOID
    writer.add_expert_gating_func(gating)
    rope = config.rope_parameters
    if rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(rope["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
        writer.add_rope_scaling_yarn_log_mul(0.1 * float(rope["mscale_all_dim"]))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(list(vocab.tokens))
    writer.add_token_types(list(vocab.token_types))
    writer.add_token_merges(list(vocab.merges))
    writer.add_bos_token_id(vocab.bos_token_id)
    writer.add_eos_token_id(vocab.eos_token_id)
    writer.add_pad_token_id(vocab.pad_token_id)
    writer.add_add_bos_token(False)
    stacks: dict[str, dict[int, np.ndarray]] = {}
    heads, nope, v = config.num_attention_heads, config.qk_nope_head_dim, config.v_head_dim
    for name, tensor in load_file(os.path.join(folder, "model.safetensors")).items():
        weight = tensor.float().numpy()
        if not name.startswith("model.layers."):
            writer.add_tensor({"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
                               "output_norm.weight", "lm_head.weight": "output.weight"}[name], weight)
            continue
        _, _, layer, rest = name.split(".", 3)
        if ".experts." in rest:  # mlp.experts.E.proj.weight -> one stack per projection
            _, _, expert, proj, _ = rest.split(".")
            stacks.setdefault(f"blk.{layer}.{_GGUF_MLP[proj]}_exps.weight", {})[int(expert)] = weight
        elif rest == "self_attn.kv_b_proj.weight" and split_kv_b:
            kv_b = weight.reshape(heads, nope + v, -1)  # [H, nope + v, r]
            writer.add_tensor(f"blk.{layer}.attn_k_b.weight", np.ascontiguousarray(kv_b[:, :nope].transpose(0, 2, 1)))
            writer.add_tensor(f"blk.{layer}.attn_v_b.weight", np.ascontiguousarray(kv_b[:, nope:]))
        else:
            writer.add_tensor(f"blk.{layer}.{_gguf_layer_name(rest)}", weight)
    for gname, per_expert in stacks.items():
        writer.add_tensor(gname, np.stack([per_expert[e] for e in sorted(per_expert)]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
