"""DeepSeek-V3.2 and GLM-5: the DeepSeek family (deepseek.py) with DeepSeek sparse attention in every layer
(cpllm/layers/sparse_mla/: MLA whose queries attend the tokens a lightning indexer selects; the cache holds the
latent row and the index key per token). Embedding, MoE, norms, LM head and rotary are the DeepSeek family's."""

from __future__ import annotations

import torch

from cpllm.config.engine import ModelConfig
from cpllm.distributed.parallel_context import ParallelContext
from cpllm.layers.sparse_mla.attention import SparseMLAAttention
from cpllm.model.families.deepseek import DeepseekDecoderLayer, DeepseekForCausalLM

ATTENTION_KIND = "sparse_mla"
"""The family's attention backend (cpllm/layers/registry.py)."""


class DeepseekSparseDecoderLayer(DeepseekDecoderLayer):
    """DeepseekDecoderLayer with SparseMLAAttention in place of MLAAttention."""

    def __init__(self, config: ModelConfig, index: int, parallel: ParallelContext, dtype: torch.dtype, backend):
        super().__init__(config, index, parallel, dtype, backend)
        scale = config.mla.softmax_scale(config.rope_scaling)
        self.self_attn = SparseMLAAttention(config.mla, config.indexer, config.hidden_size, config.num_attention_heads,
                                            scale, f"model.layers.{index}.self_attn", parallel, dtype,
                                            config.quantization, backend)


class DeepseekSparseForCausalLM(DeepseekForCausalLM):
    """DeepseekForCausalLM over sparse-attention decoder layers."""

    def __init__(self, config: ModelConfig, parallel: ParallelContext, dtype: torch.dtype, max_positions: int):
        if config.indexer is None:
            raise ValueError(f"{config.architecture} needs ModelConfig.indexer (DeepSeek sparse attention)")
        super().__init__(config, parallel, dtype, max_positions)

    def attention_kind(self) -> str:
        return ATTENTION_KIND

    def decoder_layer(self, config: ModelConfig, index: int, parallel: ParallelContext, dtype: torch.dtype,
                      max_positions: int) -> torch.nn.Module:
        return DeepseekSparseDecoderLayer(config, index, parallel, dtype, self.attention_backend)

    def eager_decode_reason(self) -> str | None:
        return "DeepSeek sparse attention"
