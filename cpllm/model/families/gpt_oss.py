"""GPT-OSS (GptOssForCausalLM): a Llama-shaped decoder whose every MLP is a sparse mixture of experts
(cpllm/model/moe/gpt_oss_block.py), with three changes to attention, all computed as transformers' reference does
(models/gpt_oss/modeling_gpt_oss.py):
- sinks: each query head has a learned logit s_h that joins its softmax denominator and contributes no value,
  out = sum_j exp(l_j) v_j / (exp(s_h) + sum_j exp(l_j)); PagedCPAttention applies it once, after its exact
  merge, so every CP layout gives the single rank's result;
- `layer_types`: sliding layers see the last `sliding_window` positions (key j visible to query i iff
  i - W < j <= i), full layers all of them; the KV pools are the same either way;
- biases on q, k, v and o (o's added once, after the TP all-reduce), and YaRN rope (cpllm/model/rope.py).
Every rank builds only its TP shard; the experts sit on the shared MoE placement (expert-TP or EP over TP x PCP).
"""

from __future__ import annotations

import torch

from cpllm.config.engine import ModelConfig
from cpllm.config.attention import layer_window
from cpllm.context_parallel.attention import PagedCPAttention
from cpllm.context_parallel.backend import AttentionBackend
from cpllm.context_parallel.metadata import AttentionMetadata
from cpllm.distributed.parallel_context import ParallelContext
from cpllm.kernels.decode_rows import rope_qk_
from cpllm.layers.window.modifier import score_mods
from cpllm.model.moe.gpt_oss_block import GptOssMoEBlock
from cpllm.model.layers import ColumnParallelLinear, RMSNorm, RowParallelLinear, RowRange
from cpllm.model.families.llama import ATTENTION_KIND, LlamaForCausalLM
from cpllm.model.loaders.loader import WeightSource
from cpllm.model.rope import apply_rope


class GptOssAttention(torch.nn.Module):
    def __init__(self, config: ModelConfig, index: int, parallel: ParallelContext, dtype: torch.dtype,
                 backend: AttentionBackend | None = None, max_positions: int | None = None):
        """`max_positions`: the longest request; a window no shorter hides nothing and is dropped."""
        super().__init__()
        prefix, d = f"model.layers.{index}.self_attn", config.head_dim
        tp_rank = parallel.rank("tp")
        self.num_heads = config.num_attention_heads // parallel.size("tp")
        first_kv, self.num_kv_heads = parallel.kv_heads(config.num_key_value_heads)
        q0, kv0 = tp_rank * self.num_heads * d, first_kv * d
        self.qkv_proj = ColumnParallelLinear(
            config.hidden_size,
            [RowRange(name=f"{prefix}.q_proj", start=q0, end=q0 + self.num_heads * d),
             RowRange(name=f"{prefix}.k_proj", start=kv0, end=kv0 + self.num_kv_heads * d),
             RowRange(name=f"{prefix}.v_proj", start=kv0, end=kv0 + self.num_kv_heads * d)],
            bias=config.attention_bias, dtype=dtype, quantization=config.quantization,
        )
        self.o_proj = RowParallelLinear(f"{prefix}.o_proj", config.num_attention_heads * d, config.hidden_size,
                                        parallel, dtype, config.quantization)
        self.o_bias_name = f"{prefix}.o_proj.bias" if config.attention_bias else None
        self.o_bias = torch.nn.Parameter(torch.zeros(config.hidden_size, dtype=dtype), requires_grad=False)
        self.sinks_name, self.first_head = f"{prefix}.sinks", tp_rank * self.num_heads
        # [Hq_local] float32: this rank's heads' sink logits, in the float32 softmax whatever the model dtype
        self.sinks = torch.nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32), requires_grad=False)
        self.window = layer_window(config, index, max_positions)
        self.attn = PagedCPAttention(parallel, d**-0.5, backend, mods=score_mods(window=self.window))  # full: None
        self.head_dim = d
        self.q_norm = self.k_norm = None  # read by shared code that asks every layer (fused_decode.py)

    def load(self, source: WeightSource) -> None:
        """The sinks and o's bias (the projections load themselves)."""
        end = self.first_head + self.num_heads
        self.sinks.copy_(source.get(self.sinks_name, dim=0, start=self.first_head, end=end, dtype=torch.float32))
        if self.o_bias_name is not None:
            self.o_bias.copy_(source.get(self.o_bias_name, dtype=self.o_bias.dtype))

    def forward(self, hidden, rope_tables, kv_cache, meta: AttentionMetadata, keep: torch.Tensor | None = None):
        """As LlamaAttention.forward: `keep` names the rows whose output is needed (None: all)."""
        n, d = hidden.shape[0], self.head_dim
        qkv = self.qkv_proj(hidden)  # [N, (Hq + 2 Hkv) * D]
        q, k, v = qkv.split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=-1)
        q, k = q.view(n, self.num_heads, d), k.view(n, self.num_kv_heads, d)
        if not rope_qk_(rope_tables, q, k):
            q, k = apply_rope(rope_tables, q), apply_rope(rope_tables, k)  # [N, Hq, D], [N, Hkv, D]
        v = v.reshape(n, self.num_kv_heads, d)
        out = self.attn(q, k, v, kv_cache[0], kv_cache[1], meta, sinks=self.sinks).reshape(n, self.num_heads * d)
        if keep is not None:
            if keep.numel() == 0:
                return out[:0]
            out = out.index_select(0, keep)
        return self.o_proj(out) + self.o_bias  # [N, hidden]: the bias once, after the sum over TP


class GptOssDecoderLayer(torch.nn.Module):
    def __init__(self, config: ModelConfig, index: int, parallel: ParallelContext, dtype: torch.dtype,
                 backend: AttentionBackend | None, max_positions: int | None):
        super().__init__()
        prefix, eps = f"model.layers.{index}", config.rms_norm_eps
        self.input_layernorm = RMSNorm(f"{prefix}.input_layernorm.weight", config.hidden_size, eps, dtype)
        self.self_attn = GptOssAttention(config, index, parallel, dtype, backend, max_positions)
        self.post_attention_layernorm = RMSNorm(f"{prefix}.post_attention_layernorm.weight", config.hidden_size,
                                                eps, dtype)
        self.mlp = GptOssMoEBlock(config, f"{prefix}.mlp", parallel, dtype)

    def forward(self, hidden, rope_tables, kv_cache, meta, keep: torch.Tensor | None = None):
        """As LlamaDecoderLayer.forward."""
        attn = self.self_attn(self.input_layernorm(hidden), rope_tables, kv_cache, meta, keep)
        if keep is not None and keep.numel() == 0:
            return hidden[:0]
        hidden = attn + (hidden if keep is None else hidden.index_select(0, keep))
        return hidden + self.mlp(self.post_attention_layernorm(hidden), meta)


class GptOssForCausalLM(LlamaForCausalLM):
    """LlamaForCausalLM's stack, loading, step paths and LM head over GPT-OSS decoder layers."""

    def attention_kind(self) -> str:
        return ATTENTION_KIND  # plain GQA everywhere: the sinks run on its paths (not the Triton kernels')

    def decoder_layer(self, config: ModelConfig, index: int, parallel: ParallelContext, dtype: torch.dtype,
                      max_positions: int) -> torch.nn.Module:
        return GptOssDecoderLayer(config, index, parallel, dtype, self.attention_backend, max_positions)
