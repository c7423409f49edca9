"""The gated-DeltaNet hybrids: Qwen3.5 (dense), Qwen3.5-MoE and Qwen3-Next, on the Llama decoder's stack.

Most layers are gated DeltaNet (cpllm/layers/gated_delta/: a state per request, read by the request's state slot);
every few layers (config.json's layer_types) is a full-attention layer over the paged K/V pools through
PagedCPAttention, with three changes from Llama's: q_proj holds each head's query and an output gate side by side
([q_h | gate_h] per head), the output is multiplied by sigmoid(gate), and rotary turns only each head's first
rotary_dim values (partial_rotary_factor). Every RMSNorm but the DeltaNet's gated one scales by (1 + w) (Gemma's
norm). The MLP is dense (Qwen3.5) or the Qwen MoE block with a gated shared expert (Qwen3.5-MoE, Qwen3-Next:
cpllm/model/moe/sparse_block.py). The embedding, LM head and the step's stack are LlamaForCausalLM's.
"""

from __future__ import annotations

import torch

from cpllm.config.engine import ModelConfig
from cpllm.context_parallel.attention import PagedCPAttention
from cpllm.context_parallel.backend import AttentionBackend
from cpllm.context_parallel.metadata import AttentionMetadata
from cpllm.distributed.parallel_context import ParallelContext
from cpllm.layers.gated_delta.layer import GatedDeltaNet
from cpllm.layers.window.modifier import score_mods
from cpllm.model.families.gemma import GemmaRMSNorm
from cpllm.model.families.llama import LlamaForCausalLM, LlamaMLP
from cpllm.model.layers import ColumnParallelLinear, RowParallelLinear, RowRange
from cpllm.model.moe.sparse_block import SparseMoEBlock
from cpllm.model.rope import RotaryEmbedding, apply_rope

ATTENTION_KIND = "gqa"
"""The full layers' attention: grouped-query heads over the paged K/V pools (the DeltaNet layers hold states)."""


class GatedAttention(torch.nn.Module):
    """A full-attention layer of the hybrids: Llama's GQA with the output gate, (1 + w) q/k norms and partial
    rotary."""

    def __init__(self, config: ModelConfig, prefix: str, parallel: ParallelContext, dtype: torch.dtype,
                 backend: AttentionBackend | None):
        super().__init__()
        d, eps = config.head_dim, config.rms_norm_eps
        self.num_heads = config.num_attention_heads // parallel.size("tp")
        first_kv, self.num_kv_heads = parallel.kv_heads(config.num_key_value_heads)
        q0, kv0 = parallel.rank("tp") * self.num_heads * 2 * d, first_kv * d  # q_proj rows: [q_h | gate_h] per head
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, [
            RowRange(name=f"{prefix}.q_proj", start=q0, end=q0 + self.num_heads * 2 * d),
            RowRange(name=f"{prefix}.k_proj", start=kv0, end=kv0 + self.num_kv_heads * d),
            RowRange(name=f"{prefix}.v_proj", start=kv0, end=kv0 + self.num_kv_heads * d),
        ], bias=config.attention_bias, dtype=dtype, quantization=config.quantization)
        self.o_proj = RowParallelLinear(f"{prefix}.o_proj", config.num_attention_heads * d, config.hidden_size,
                                        parallel, dtype, config.quantization)
        self.attn = PagedCPAttention(parallel, scale=d**-0.5, backend=backend, mods=score_mods(window=None))
        self.q_norm = GemmaRMSNorm(f"{prefix}.q_norm.weight", d, eps, dtype)
        self.k_norm = GemmaRMSNorm(f"{prefix}.k_norm.weight", d, eps, dtype)
        self.head_dim, self.rotary_dim = d, config.linear_attention.rotary_dim
        self.window = None  # full attention (LlamaForCausalLM.eager_decode_reason reads it)

    def _rotate(self, tables, x: torch.Tensor) -> torch.Tensor:
        """x [N, heads, D] with its first rotary_dim values of each head rotated."""
        r = self.rotary_dim
        return torch.cat([apply_rope(tables, x[..., :r]), x[..., r:]], dim=-1) if r < x.shape[-1] else \
            apply_rope(tables, x)

    def forward(self, hidden, rope_tables, kv_cache, meta: AttentionMetadata, keep: torch.Tensor | None = None):
        n, d, h = hidden.shape[0], self.head_dim, self.num_heads
        q_gate, k, v = self.qkv_proj(hidden).split([h * 2 * d, self.num_kv_heads * d, self.num_kv_heads * d], -1)
        q, gate = q_gate.view(n, h, 2 * d).split(d, dim=-1)  # [N, H, D] each
        q = self._rotate(rope_tables, self.q_norm(q.contiguous()))
        k = self._rotate(rope_tables, self.k_norm(k.reshape(n, self.num_kv_heads, d)))
        v = v.reshape(n, self.num_kv_heads, d)
        out = self.attn(q, k, v, kv_cache[0], kv_cache[1], meta).reshape(n, h * d)
        out = out * torch.sigmoid(gate.reshape(n, h * d))
        if keep is not None:
            if keep.numel() == 0:
                return out[:0]  # no row wanted: no projection (nor its all-reduce) on any rank
            out = out.index_select(0, keep)
        return self.o_proj(out)


class HybridDecoderLayer(torch.nn.Module):
    """Pre-norm token mixer (gated DeltaNet or gated attention) and MLP, residual adds, `keep` on the last layer."""

    def __init__(self, config: ModelConfig, index: int, parallel: ParallelContext, dtype: torch.dtype,
                 backend: AttentionBackend):
        super().__init__()
        prefix, h, eps = f"model.layers.{index}", config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(f"{prefix}.input_layernorm.weight", h, eps, dtype)
        self.post_attention_layernorm = GemmaRMSNorm(f"{prefix}.post_attention_layernorm.weight", h, eps, dtype)
        self.self_attn = self.linear_attn = None
        if index in config.linear_attention.linear_layers:
            self.linear_attn = GatedDeltaNet(config.linear_attention, h, eps, f"{prefix}.linear_attn", parallel,
                                             dtype, config.quantization)
        else:
            self.self_attn = GatedAttention(config, f"{prefix}.self_attn", parallel, dtype, backend)
        if config.moe is not None and config.moe.is_sparse(index):
            self.mlp = SparseMoEBlock(config, f"{prefix}.mlp", parallel, dtype)
        else:
            self.mlp = LlamaMLP(config, f"{prefix}.mlp", parallel, dtype)

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


class Qwen35ForCausalLM(LlamaForCausalLM):
    """LlamaForCausalLM's stack, loading, step paths and LM head over the hybrid decoder layers."""

    def __init__(self, config: ModelConfig, parallel: ParallelContext, dtype: torch.dtype, max_positions: int):
        if config.linear_attention is None:
            raise ValueError(f"{config.architecture} needs ModelConfig.linear_attention")
        super().__init__(config, parallel, dtype, max_positions)
        self.tp_size = parallel.size("tp")
        """Ranks the DeltaNet heads split over (the start-up log sizes their states by it)."""

    def attention_kind(self) -> str:
        return ATTENTION_KIND  # plain GQA: its steps are never captured as CUDA graphs (the state layers are eager)

    def decoder_layer(self, config: ModelConfig, index: int, parallel: ParallelContext, dtype: torch.dtype,
                      max_positions: int) -> torch.nn.Module:
        return HybridDecoderLayer(config, index, parallel, dtype, self.attention_backend)

    def final_norm(self, config: ModelConfig, dtype: torch.dtype) -> torch.nn.Module:
        return GemmaRMSNorm("model.norm.weight", config.hidden_size, config.rms_norm_eps, dtype)

    def rotary(self, config: ModelConfig, max_positions: int) -> torch.nn.Module:
        return RotaryEmbedding(config.linear_attention.rotary_dim, config.rope_theta, config.rope_scaling,
                               max_positions)

    def eager_decode_reason(self) -> str | None:
        return "gated DeltaNet layers (a recurrent state per request)"  # the fused C layers compute GQA layers

    def pack_weights(self) -> None:
        """Every projection and shared expert in oneDNN's layout (the routed experts pack at load)."""
        for layer in self.layers:
            mixer = layer.self_attn if layer.self_attn is not None else layer.linear_attn
            linears = [mixer.qkv_proj, mixer.o_proj] if layer.self_attn is not None else \
                [mixer.in_proj, mixer.out_proj]
            shared = getattr(layer.mlp, "shared_expert", None)
            if shared is not None:
                linears += [shared.gate_up_proj, shared.down_proj]
            for linear in linears:
                linear.prepack()
