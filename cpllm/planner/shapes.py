"""What the cost model counts per layer of a model, for dense, mixture-of-experts and latent-attention (MLA)
models alike: the weights a token passes through, the weights stored, and the attention work per (query, key)
pair.

- MoE (Mixtral, Qwen-MoE, DeepSeek): a sparse layer's token passes through its top-k routed experts, the shared
  expert and the router; every expert is stored. Dense layers (DeepSeek's first_k_dense_replace) keep the
  model's intermediate_size.
- MLA (DeepSeek-V2 arXiv 2405.04434 section 2.1, V3): queries directly (q_lora_rank None) or through a rank-q
  latent, one down-projection of the hidden state to the latent and the rope key (kv_lora_rank +
  qk_rope_head_dim), the latent's up-projection to every head's key (nope part) and value, the output
  projection. A prefill expands the latent and attends as multi-head attention (cpllm's MLA prefill, and
  vLLM's), so a (query, key) pair costs 2 qk_head_dim + 2 v_head_dim FLOPs per head.
"""

from __future__ import annotations

from cpllm.config.engine import ModelConfig


def attention_params(m: ModelConfig) -> int:
    """Weights of one layer's attention projections."""
    h, heads = m.hidden_size, m.num_attention_heads
    if m.mla is None:
        return 2 * h * heads * m.head_dim + 2 * h * m.num_key_value_heads * m.head_dim
    mla = m.mla
    if mla.q_lora_rank is None:
        q = h * heads * mla.qk_head_dim
    else:
        q = h * mla.q_lora_rank + mla.q_lora_rank * heads * mla.qk_head_dim
    kv_down = h * (mla.kv_lora_rank + mla.qk_rope_head_dim)
    kv_up = mla.kv_lora_rank * heads * (mla.qk_nope_head_dim + mla.v_head_dim)
    return q + kv_down + kv_up + heads * mla.v_head_dim * h


def mlp_params(m: ModelConfig, layer: int, *, active: bool) -> int:
    """Weights of layer `layer`'s MLP: those one token passes through (`active`), or all of them."""
    h, moe = m.hidden_size, m.moe
    if moe is None or not moe.is_sparse(layer):
        return 3 * h * m.intermediate_size
    experts = moe.top_k if active else moe.num_experts
    return 3 * h * (experts * moe.intermediate_size + moe.shared_expert_intermediate_size) + h * moe.num_experts


def linear_params(m: ModelConfig, *, active: bool) -> int:
    """Weights of every layer's matmuls (embedding and LM head apart): per token (`active`) or stored."""
    layers = m.num_hidden_layers
    return layers * attention_params(m) + sum(mlp_params(m, i, active=active) for i in range(layers))


def routed_expert_params(m: ModelConfig) -> int:
    """Weights of every routed expert of every sparse layer (what cpllm splits over the TP x PCP MoE group)."""
    moe = m.moe
    if moe is None:
        return 0
    sparse = sum(moe.is_sparse(i) for i in range(m.num_hidden_layers))
    return sparse * 3 * m.hidden_size * moe.num_experts * moe.intermediate_size


def attention_flops_per_pair(m: ModelConfig) -> int:
    """FLOPs of one (query, key) pair in one layer, all heads: QK^T and PV."""
    if m.mla is None:
        return 4 * m.head_dim * m.num_attention_heads
    return 2 * (m.mla.qk_head_dim + m.mla.v_head_dim) * m.num_attention_heads
