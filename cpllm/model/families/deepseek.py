"""DeepSeek-V2 / V3 (also Kimi-K2) and GLM-4.7-Flash: multi-head latent attention and the DeepSeek MoE on the
Llama decoder's stack.

A decoder layer is the Llama one (pre-norm attention and MLP, residual adds, `keep` on the last layer) with two
parts swapped: attention is MLAAttention (mla_attention.py), which caches one latent row per token in the layer's
latent pool (a `latent_attention` KV group, cpllm/kv_groups.py) and attends it in the absorbed form through
PagedCPAttention with the MLA backend, under every plan the CP layer has; the MLP is a DeepseekMoEBlock
(deepseek_moe.py) on a sparse layer, a dense LlamaMLP of `intermediate_size` on the others (`first_k_dense_replace`,
`moe_layer_freq`, GLM's `mlp_layer_types`: MoEConfig.mlp_only_layers). The embedding, final norm, LM head and the
step's stack are LlamaForCausalLM's. The rotary tables are qk_rope_head_dim wide (only the decoupled rope part of
queries and keys rotates), and the softmax scale carries YaRN's mscale correction (MLAConfig.softmax_scale).
"""

from __future__ import annotations

import torch

from cpllm.config.engine import ModelConfig
from cpllm.context_parallel.backend import AttentionBackend
from cpllm.distributed.comm import low_latency
from cpllm.distributed.parallel_context import ParallelContext
from cpllm.layers.mla.attention import MLAAttention
from cpllm.model.moe.deepseek_block import DeepseekMoEBlock
from cpllm.model.layers import RMSNorm
from cpllm.model.families.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from cpllm.model.rope import RotaryEmbedding

ATTENTION_KIND = "mla"
"""The family's attention: latent rows in one pool per layer (`BACKENDS` in backend.py)."""


class DeepseekDecoderLayer(LlamaDecoderLayer):
    """LlamaDecoderLayer's forward over MLA and the DeepSeek MLP of layer `index`."""

    def __init__(self, config: ModelConfig, index: int, parallel: ParallelContext, dtype: torch.dtype,
                 backend: AttentionBackend):
        torch.nn.Module.__init__(self)  # LlamaDecoderLayer's constructor would build GQA attention
        prefix, eps, h = f"model.layers.{index}", config.rms_norm_eps, config.hidden_size
        self.input_layernorm = RMSNorm(f"{prefix}.input_layernorm.weight", h, eps, dtype)
        scale = config.mla.softmax_scale(config.rope_scaling)
        self.self_attn = MLAAttention(config.mla, h, config.num_attention_heads, scale, f"{prefix}.self_attn",
                                      parallel, dtype, config.quantization, backend)
        self.post_attention_layernorm = RMSNorm(f"{prefix}.post_attention_layernorm.weight", h, eps, dtype)
        if config.moe.is_sparse(index):
            self.mlp = DeepseekMoEBlock(h, config.moe, f"{prefix}.mlp", parallel, dtype, config.quantization)
        else:
            split = not parallel.dims.kv_replicated and low_latency(parallel.group("pcp"))
            self.mlp = LlamaMLP(config, f"{prefix}.mlp", parallel, dtype, split)


class DeepseekForCausalLM(LlamaForCausalLM):
    """LlamaForCausalLM's stack, loading, step paths and LM head over DeepSeek decoder layers."""

    def __init__(self, config: ModelConfig, parallel: ParallelContext, dtype: torch.dtype, max_positions: int):
        if config.mla is None or config.moe is None:
            raise ValueError(f"{config.architecture} needs ModelConfig.mla and ModelConfig.moe")
        super().__init__(config, parallel, dtype, max_positions)

    def attention_kind(self) -> str:
        return ATTENTION_KIND

    def decoder_layer(self, config: ModelConfig, index: int, parallel: ParallelContext, dtype: torch.dtype,
                      max_positions: int) -> torch.nn.Module:
        return DeepseekDecoderLayer(config, index, parallel, dtype, self.attention_backend)

    def rotary(self, config: ModelConfig, max_positions: int) -> torch.nn.Module:
        # only the decoupled rope part of queries and keys rotates
        return RotaryEmbedding(config.mla.qk_rope_head_dim, config.rope_theta, config.rope_scaling, max_positions)

    def eager_decode_reason(self) -> str | None:
        return "multi-head latent attention"  # the fused C layers compute GQA layers

    def pack_weights(self) -> None:
        """The attention's output projection and the shared experts in oneDNN's layout, as LlamaForCausalLM
        packs its own (the routed experts pack at load)."""
        for layer in self.layers:
            linears = [layer.self_attn.o_proj]
            shared = getattr(layer.mlp, "shared_expert", None)
            if shared is not None:
                linears += [shared.gate_up_proj, shared.down_proj]
            for linear in linears:
                linear.prepack()
