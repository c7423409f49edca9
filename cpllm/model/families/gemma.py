"""Gemma2 and Gemma3 (text): the Llama layers' projections, attention and TP/CP plumbing, with Gemma's changes,
each computed as transformers 5 computes it (models/gemma2, models/gemma3):
- sliding and full layers (`layer_types`; Gemma2 alternates them, Gemma3 has five sliding layers per full one),
  the window applied by PagedCPAttention (key j visible to query i iff i - W < j <= i);
- scores scaled by query_pre_attn_scalar ** -0.5; Gemma2 soft-caps them, s -> c * tanh(s / c), before the mask
  (the layer's score modifier, cpllm/layers/window/modifier.py), and both families may soft-cap the final logits the same way;
- every RMSNorm multiplies by (1 + w), in float32, the result cast back to the model dtype;
- four norms per layer: before and after attention, before and after the MLP ("sandwich"), each output norm
  applied before its residual add; Gemma3 also norms every query and key head (q_norm / k_norm) before rotary;
- the MLP is GeGLU: gelu_tanh(gate) * up;
- the embedding is multiplied by sqrt(hidden_size), that factor first rounded to the model dtype;
- Gemma3's sliding layers rotate with their own base (rope_local_base_freq, unscaled), its full layers with
  rope_theta and rope_scaling (linear in the released models).
The fused C decode layers compute Llama layers, so Gemma decodes through the eager layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cpllm.config.engine import ModelConfig
from cpllm.config.attention import FULL, SLIDING, layer_kind, layer_window
from cpllm.context_parallel.attention import PagedCPAttention
from cpllm.context_parallel.backend import AttentionBackend
from cpllm.context_parallel.metadata import AttentionMetadata
from cpllm.distributed.parallel_context import ParallelContext
from cpllm.layers.window.modifier import score_mods
from cpllm.model.layers import RMSNorm, VocabParallelEmbedding
from cpllm.model.families.llama import ATTENTION_KIND, LlamaAttention, LlamaForCausalLM, LlamaMLP
from cpllm.model.loaders.loader import WeightSource
from cpllm.model.rope import RotaryEmbedding


class GemmaRMSNorm(RMSNorm):
    """x / rms(x) * (1 + w) in float32, cast to x's dtype. The stored w is read at the model dtype (as
    transformers holds it) and kept as 1 + w in float32, the factor transformers computes on every call."""

    def __init__(self, name: str, hidden: int, eps: float, dtype: torch.dtype):
        super().__init__(name, hidden, eps, torch.float32)
        self.stored_dtype = dtype

    def load(self, source: WeightSource) -> None:
        self.weight.copy_(1.0 + source.get(self.name, dtype=self.stored_dtype).float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return super().forward(x)  # the C kernel or torch's rms_norm, with the (1 + w) factor as weight
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight).to(x.dtype)


class GemmaEmbedding(VocabParallelEmbedding):
    """The TP token embedding times sqrt(hidden_size) rounded to the model dtype (the rows a tied LM head reads
    are the unscaled ones)."""

    def __init__(self, name: str, vocab_size: int, hidden: int, parallel: ParallelContext, dtype: torch.dtype, quantization: str):
        super().__init__(name, vocab_size, hidden, parallel, dtype, quantization)
        self.register_buffer("normalizer", torch.tensor(hidden**0.5).to(dtype), persistent=False)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        # token_ids [N] -> [N, hidden]
        return super().forward(token_ids) * self.normalizer


class GemmaRopes(torch.nn.Module):
    """One rotary table per layer kind: Gemma3's sliding layers have their own base, Gemma2's share one table."""

    def __init__(self, config: ModelConfig, max_positions: int):
        super().__init__()
        d = config.head_dim
        self.full = RotaryEmbedding(d, config.rope_theta, config.rope_scaling, max_positions)
        self.local = None if config.rope_local_theta is None else RotaryEmbedding(
            d, config.rope_local_theta, None, max_positions)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The step's tables per layer kind (RotaryEmbedding.tables), each looked up once per step."""
        full = self.full.tables(positions, dtype)
        return {FULL: full, SLIDING: full if self.local is None else self.local.tables(positions, dtype)}


class GemmaAttention(LlamaAttention):
    """LlamaAttention's projections and forward, with Gemma's scale, soft-cap, window and (1 + w) q/k norms."""

    def __init__(self, config: ModelConfig, prefix: str, parallel: ParallelContext, dtype: torch.dtype,
                 backend: AttentionBackend | None, window: int | None):
        super().__init__(config, prefix, parallel, dtype, backend, window)
        scale = (config.query_pre_attn_scalar or config.head_dim) ** -0.5
        self.attn = PagedCPAttention(parallel, scale, backend,
                                     mods=score_mods(window=window, softcap=config.attn_logit_softcapping))
        if config.qk_norm:  # Gemma3
            d, eps = config.head_dim, config.rms_norm_eps
            self.q_norm = GemmaRMSNorm(f"{prefix}.q_norm.weight", d, eps, dtype)
            self.k_norm = GemmaRMSNorm(f"{prefix}.k_norm.weight", d, eps, dtype)


class GemmaMLP(LlamaMLP):
    """gate|up and down as LlamaMLP (no PCP decode split), with GeGLU: gelu_tanh(gate) * up."""

    def __init__(self, config: ModelConfig, prefix: str, parallel: ParallelContext, dtype: torch.dtype):
        super().__init__(config, prefix, parallel, dtype, False)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata | None = None) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.shard, dim=-1)  # [N, I / TP] each
        return self.down_proj(F.gelu(gate, approximate="tanh").mul_(up))  # in place: no second [N, I] buffer


class GemmaDecoderLayer(torch.nn.Module):
    def __init__(self, config: ModelConfig, index: int, parallel: ParallelContext, dtype: torch.dtype,
                 backend: AttentionBackend | None, max_positions: int):
        super().__init__()
        prefix, h, eps = f"model.layers.{index}", config.hidden_size, config.rms_norm_eps
        norm = lambda name: GemmaRMSNorm(f"{prefix}.{name}.weight", h, eps, dtype)  # noqa: E731
        self.input_layernorm, self.post_attention_layernorm = norm("input_layernorm"), norm("post_attention_layernorm")
        self.pre_feedforward_layernorm = norm("pre_feedforward_layernorm")
        self.post_feedforward_layernorm = norm("post_feedforward_layernorm")
        self.kind = layer_kind(config, index)
        """Which rotary table the layer reads (a sliding layer keeps its base even where its window is dropped)."""
        self.self_attn = GemmaAttention(config, f"{prefix}.self_attn", parallel, dtype, backend,
                                        layer_window(config, index, max_positions))
        self.mlp = GemmaMLP(config, f"{prefix}.mlp", parallel, dtype)

    def forward(self, hidden, rope_tables, kv_cache, meta, keep: torch.Tensor | None = None):
        """As LlamaDecoderLayer.forward; `rope_tables` holds one table per layer kind (GemmaRopes.tables)."""
        attn = self.self_attn(self.input_layernorm(hidden), rope_tables[self.kind], kv_cache, meta, keep)
        if keep is not None and keep.numel() == 0:  # no row wanted: the K/V store was all there was to do
            return hidden[:0]
        hidden = (hidden if keep is None else hidden.index_select(0, keep)) + self.post_attention_layernorm(attn)
        return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))


class GemmaForCausalLM(LlamaForCausalLM):
    """LlamaForCausalLM's stack, loading and step paths over Gemma layers, with the scaled embedding, the (1 + w)
    final norm and the soft-capped logits."""

    def attention_kind(self) -> str:
        return ATTENTION_KIND  # plain GQA everywhere: soft-capped scores run on its math path

    def embedding(self, config: ModelConfig, parallel: ParallelContext, dtype: torch.dtype) -> torch.nn.Module:
        return GemmaEmbedding("model.embed_tokens.weight", config.vocab_size, config.hidden_size, parallel, dtype,
                              config.quantization)

    def decoder_layer(self, config: ModelConfig, index: int, parallel: ParallelContext, dtype: torch.dtype,
                      max_positions: int) -> torch.nn.Module:
        return GemmaDecoderLayer(config, index, parallel, dtype, self.attention_backend, max_positions)  # dense MLPs

    def final_norm(self, config: ModelConfig, dtype: torch.dtype) -> torch.nn.Module:
        return GemmaRMSNorm("model.norm.weight", config.hidden_size, config.rms_norm_eps, dtype)

    def rotary(self, config: ModelConfig, max_positions: int) -> torch.nn.Module:
        return GemmaRopes(config, max_positions)

    def eager_decode_reason(self) -> str | None:
        return "Gemma layers: sandwich norms, GeGLU, soft-capping"

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden [M, hidden_size] -> logits [M, vocab] float32, soft-capped where the model says
        logits = self.lm_head(self.norm(hidden))
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
