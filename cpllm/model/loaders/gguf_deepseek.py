"""llama.cpp's `deepseek2` GGUF architecture (DeepSeek-V2 / V3, Kimi-K2): its metadata read back into a config.json
dictionary, and its tensor names mapped onto Hugging Face's.

The metadata becomes the config.json fields ModelConfig.from_hf_config reads, so a GGUF file and an HF folder go
through the same config code:
- the router: `expert_gating_func` 1 (softmax) is DeepSeek-V2's, greedy, or group-limited when `expert_group_count`
  > 1; 2 (sigmoid) is V3's noaux_tc over `expert_group_count` groups, `expert_group_used_count` of them;
  `expert_weights_scale` is routed_scaling_factor, `expert_weights_norm` norm_topk_prob;
- MLA's widths: `attention.kv_lora_rank`, `attention.q_lora_rank` (absent: queries direct), `rope.dimension_count`,
  and the per-head key / value widths in `attention.key_length_mla` / `value_length_mla` (current converters;
  their `key_length` / `value_length` are then the latent's) or, in older files, `key_length` / `value_length`;
- YaRN: `rope.scaling.yarn_log_multiplier` is 0.1 x mscale_all_dim; the file keeps no `mscale`, and llama.cpp
  takes it equal to mscale_all_dim (as every published DeepSeek config has it), so cpllm does too;
- rotary pairs are interleaved (llama.cpp's rope for this architecture; its converter stores q / k unpermuted).
Tensors: the MLA projections by their llama.cpp names; kv_b_proj either whole (`attn_kv_b`, older files) or split
as current converters write it (`attn_k_b` [H, r, nope], the key part transposed, and `attn_v_b` [H, v, r]),
offered as `k_b_proj` / `v_b_proj`, which MLAAttention joins back into kv_b_proj's rows; the router's correction
bias `exp_probs_b`; the shared experts `ffn_*_shexp`; stacked experts as for every MoE file (gguf_moe.py).
"""

from __future__ import annotations

from typing import Any, Callable

DEEPSEEK_GGUF_ARCH = "deepseek2"

_LAYER_NAMES = {
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
    "attn_k_b.weight": "self_attn.k_b_proj.weight",
    "attn_v_b.weight": "self_attn.v_b_proj.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
}


def deepseek_layer_name(rest: str) -> str | None:
    """The HF name (after `model.layers.N.`) of a deepseek2 layer tensor this module maps, else None."""
    return _LAYER_NAMES.get(rest)


def deepseek_rope_scaling(meta: Callable[[str, Any], Any], arch: str = DEEPSEEK_GGUF_ARCH) -> dict[str, Any] | None:
    """config.json's rope_scaling from an MLA file's `rope.scaling.*` keys (deepseek2's, or another architecture
    written by the same DeepseekV2Model converter: glm-dsa): none or YaRN."""
    key = lambda name: f"{arch}.rope.scaling.{name}"  # noqa: E731
    kind = meta(key("type"), None)
    if kind in (None, "none"):
        return None
    if kind != "yarn":
        raise ValueError(f"{arch} GGUF rope scaling type {kind!r}: only yarn is supported")
    # llama.cpp's yarn ramp defaults (the converter writes no beta for this architecture)
    scaling = {"rope_type": "yarn", "factor": float(meta(key("factor"), 1.0)),
               "original_max_position_embeddings": int(meta(key("original_context_length"), 4096)),
               "beta_fast": float(meta(key("yarn_beta_fast"), 32.0)),
               "beta_slow": float(meta(key("yarn_beta_slow"), 1.0))}
    log_mul = meta(key("yarn_log_multiplier"), None)
    if log_mul:  # stored as float32: rounded back to the config's decimal value
        scaling["mscale_all_dim"] = scaling["mscale"] = round(float(log_mul) / 0.1, 6)
    return scaling


def deepseek_hf_config(meta: Callable[[str, Any], Any], tensor_shapes: dict[str, tuple[int, ...]],
                       eos_ids: tuple[int, ...]) -> dict[str, Any]:
    """The config.json dictionary of a deepseek2 GGUF file (see the module)."""
    m = lambda name, default=None: meta(f"{DEEPSEEK_GGUF_ARCH}.{name}", default)  # noqa: E731
    sigmoid = int(m("expert_gating_func", 1)) == 2
    groups = int(m("expert_group_count", 1) or 1)
    rope = int(m("rope.dimension_count"))
    split_widths = m("attention.key_length_mla") is not None
    key_width = int(m("attention.key_length_mla") if split_widths else m("attention.key_length"))
    value_width = int(m("attention.value_length_mla") if split_widths else m("attention.value_length"))
    bos = meta("tokenizer.ggml.bos_token_id", None)
    cfg: dict[str, Any] = dict(
        architectures=["DeepseekV3ForCausalLM" if sigmoid else "DeepseekV2ForCausalLM"],
        vocab_size=tensor_shapes["token_embd.weight"][0], hidden_size=int(m("embedding_length")),
        intermediate_size=int(m("feed_forward_length")), moe_intermediate_size=int(m("expert_feed_forward_length")),
        num_hidden_layers=int(m("block_count")), num_attention_heads=int(m("attention.head_count")),
        kv_lora_rank=int(m("attention.kv_lora_rank")), q_lora_rank=int(m("attention.q_lora_rank", 0)) or None,
        qk_rope_head_dim=rope, qk_nope_head_dim=key_width - rope, v_head_dim=value_width, rope_interleave=True,
        n_routed_experts=int(m("expert_count")), num_experts_per_tok=int(m("expert_used_count")),
        n_shared_experts=int(m("expert_shared_count", 0)), routed_scaling_factor=float(m("expert_weights_scale", 1.0)),
        norm_topk_prob=bool(m("expert_weights_norm", False)), n_group=groups,
        topk_group=int(m("expert_group_used_count", 1) or 1),
        first_k_dense_replace=int(m("leading_dense_block_count", 0)),
        rms_norm_eps=float(m("attention.layer_norm_rms_epsilon", 1e-6)), rope_theta=float(m("rope.freq_base", 10000.0)),
        rope_scaling=deepseek_rope_scaling(meta), max_position_embeddings=int(m("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensor_shapes, bos_token_id=None if bos is None else int(bos),
        eos_token_id=list(eos_ids),
    )
    if not sigmoid:
        cfg["topk_method"] = "group_limited_greedy" if groups > 1 else "greedy"
    return cfg
