"""Kimi Linear (KimiLinearForCausalLM): Kimi delta attention layers interleaved with MLA layers, on the DeepSeek
mixture of experts and the Llama decoder's stack.

Most layers are Kimi delta attention (cpllm/layers/kimi_delta/: a state per request, read by the request's state
slot); the others (config.json's layer_types 'full_attention') are MLA over the latent pools (cpllm/layers/mla/,
one latent row per token through PagedCPAttention under every plan), with no rotary: MLAConfig.rotary is off, so
the keys' shared rope part and each query's are used as projected. Both sit under the checkpoint's
`model.layers.{i}.self_attn`. The MLP is a dense LlamaMLP on the first layers (mlp_layer_types 'dense') and the
DeepSeek MoE block elsewhere (sigmoid router with the correction bias over expert groups, shared experts), stored
under `block_sparse_moe` with Mixtral's expert names (w1 gate, w3 up, w2 down). The norms are plain RMSNorms; the
embedding, final norm, LM head and the step's stack are LlamaForCausalLM's.
"""

from __future__ import annotations

import torch

from cpllm.config.engine import ModelConfig
from cpllm.context_parallel.backend import AttentionBackend
from cpllm.distributed.comm import low_latency
from cpllm.distributed.parallel_context import ParallelContext
from cpllm.layers.kimi_delta.layer import KimiDeltaAttention
from cpllm.layers.mla.attention import MLAAttention
from cpllm.model.families.llama import LlamaForCausalLM, LlamaMLP
from cpllm.model.layers import RMSNorm
from cpllm.model.moe.deepseek_block import DeepseekMoEBlock
from cpllm.model.rope import RotaryEmbedding

ATTENTION_KIND = "mla"
"""The full layers' attention: latent rows in one pool per layer (the KDA layers hold states)."""


class KimiDecoderLayer(torch.nn.Module):
    """Pre-norm token mixer (KDA or MLA) and MLP, residual adds, `keep` on the last layer."""

    def __init__(self, config: ModelConfig, index: int, parallel: ParallelContext, dtype: torch.dtype,
                 backend: AttentionBackend):
        super().__init__()
        prefix, h, eps = f"model.layers.{index}", config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(f"{prefix}.input_layernorm.weight", h, eps, dtype)
        self.post_attention_layernorm = RMSNorm(f"{prefix}.post_attention_layernorm.weight", h, eps, dtype)
        self.self_attn = self.linear_attn = None
        if index in config.kimi_delta.linear_layers:
            self.linear_attn = KimiDeltaAttention(config.kimi_delta, h, f"{prefix}.self_attn", parallel, dtype,
                                                  config.quantization)
        else:
            scale = config.mla.softmax_scale(config.rope_scaling)
            self.self_attn = MLAAttention(config.mla, h, config.num_attention_heads, scale, f"{prefix}.self_attn",
                                          parallel, dtype, config.quantization, backend)
        if config.moe.is_sparse(index):
            self.mlp = DeepseekMoEBlock(h, config.moe, f"{prefix}.{config.moe.expert_prefix}", parallel, dtype,
                                        config.quantization)
        else:
            split = not parallel.dims.kv_replicated and low_latency(parallel.group("pcp"))
            self.mlp = LlamaMLP(config, f"{prefix}.mlp", parallel, dtype, split)

    def forward(self, hidden, rope_tables, kv_cache, meta, keep: torch.Tensor | None = None):
        x = self.input_layernorm(hidden)
        if self.self_attn is not None:
            mixed = self.self_attn(x, rope_tables, kv_cache, meta, keep)
        else:  # every row advances its request's state, wanted or not
            mixed = self.linear_attn(x, kv_cache, meta)
            if keep is not None:
                mixed = mixed.index_select(0, keep)
        if keep is not None and keep.numel() == 0:
            return hidden[:0]
        hidden = mixed + (hidden if keep is None else hidden.index_select(0, keep))
        return hidden + self.mlp(self.post_attention_layernorm(hidden), meta)


class DenseMLPNames:
    """A weight source that finds a dense layer's `mlp.*` tensors under `block_sparse_moe.*` where the file keeps
    them there: transformers' save_pretrained renames every `.mlp.` of a Kimi Linear model back to the original
    checkpoint's `.block_sparse_moe.`, the dense layers' too, while the original checkpoints keep `mlp` for those."""

    NAMED = ("get", "has", "storage_type", "get_int4_groups", "get_int8_groups")
    """The source's methods whose first argument is a tensor name."""

    def __init__(self, source):
        self.source = source

    def _name(self, name: str) -> str:
        if ".mlp." in name and not self.source.has(name):
            moved = name.replace(".mlp.", ".block_sparse_moe.", 1)
            if self.source.has(moved):
                return moved
        return name

    def __getattr__(self, attr: str):
        method = getattr(self.source, attr)
        if attr not in self.NAMED:
            return method
        return lambda name, *args, **kwargs: method(self._name(name), *args, **kwargs)


class KimiLinearForCausalLM(LlamaForCausalLM):
    """LlamaForCausalLM's stack, loading, step paths and LM head over Kimi decoder layers."""

    def __init__(self, config: ModelConfig, parallel: ParallelContext, dtype: torch.dtype, max_positions: int):
        if config.kimi_delta is None or config.mla is None or config.moe is None:
            raise ValueError(f"{config.architecture} needs ModelConfig.kimi_delta, .mla and .moe")
        super().__init__(config, parallel, dtype, max_positions)
        self.tp_size = parallel.size("tp")
        """Ranks the KDA heads split over (the start-up log sizes their states by it)."""

    def attention_kind(self) -> str:
        return ATTENTION_KIND

    def load_weights(self, source) -> None:
        super().load_weights(DenseMLPNames(source))

    def decoder_layer(self, config: ModelConfig, index: int, parallel: ParallelContext, dtype: torch.dtype,
                      max_positions: int) -> torch.nn.Module:
        return KimiDecoderLayer(config, index, parallel, dtype, self.attention_backend)

    def rotary(self, config: ModelConfig, max_positions: int) -> torch.nn.Module:
        # the stack builds tables every step; the MLA layers read none (MLAConfig.rotary is off)
        return RotaryEmbedding(config.mla.qk_rope_head_dim, config.rope_theta, None, max_positions)

    def eager_decode_reason(self) -> str | None:
        return "Kimi delta attention layers (a recurrent state per request) and MLA"

    def pack_weights(self) -> None:
        """The projections and shared experts in oneDNN's layout (the routed experts pack at load)."""
        for layer in self.layers:
            if layer.self_attn is not None:
                linears = [layer.self_attn.o_proj]
            else:
                kda = layer.linear_attn
                linears = [kda.in_proj, kda.f_b_proj, kda.g_b_proj, kda.o_proj]
            shared = getattr(layer.mlp, "shared_expert", None)
            if shared is not None:
                linears += [shared.gate_up_proj, shared.down_proj]
            for linear in linears:
                linear.prepack()
