"""The lightning indexer of one sparse-MLA layer (DeepSeek-V3.2, GLM-5), as transformers 5.24 computes it:

    q_idx  = wq_b(q_resid)                         [N, Hi, D]   (q_resid = q_a_layernorm(q_a_proj(x)), MLA's)
    k_idx  = LayerNorm(wk(x))                      [N, D]       (eps 1e-6, with a bias)
    the first qk_rope_head_dim values of both rotated (half-split pairs in DeepSeek-V3.2, interleaved in GLM-5)
    w      = weights_proj(x) * Hi ** -0.5          [N, Hi]      (float32)
    score[l, t] = sum_h w[l, h] * ReLU(q_idx[l, h] . k_idx[t] * D ** -0.5)
Every TP rank computes all Hi heads (the weights are replicated: the scores, hence the selection, agree on every
TP rank). The index key is cached per position (the layer's index pool)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cpllm.config.sparse_mla import IndexerConfig
from cpllm.kernels import index_scores as index_kernel
from cpllm.model.layers import ColumnParallelLinear, RowRange
from cpllm.model.loaders.loader import WeightSource
from cpllm.model.rope import apply_rope

INDEX_NORM_EPS = 1e-6
"""Epsilon of the index key's LayerNorm (transformers' value)."""
SCORE_BLOCK = 64
"""Query rows scored at once (bounds the [rows, Hi, T] intermediate of a long prefill)."""


class LayerNorm(torch.nn.Module):
    """Replicated LayerNorm with weight and bias, computed in float32."""

    def __init__(self, name: str, width: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.name, self.eps = name, eps
        self.weight = torch.nn.Parameter(torch.empty(width, dtype=dtype), requires_grad=False)
        self.bias = torch.nn.Parameter(torch.empty(width, dtype=dtype), requires_grad=False)

    def load(self, source: WeightSource) -> None:
        self.weight.copy_(source.get(f"{self.name}.weight", dtype=self.weight.dtype))
        self.bias.copy_(source.get(f"{self.name}.bias", dtype=self.bias.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.layer_norm(x.float(), self.weight.shape, self.weight.float(), self.bias.float(), self.eps)
        return out.to(x.dtype)


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    # [..., d] pairs (0, 1), (2, 3) -> evens then odds: the half-split rotary then rotates the same pairs
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class Indexer(torch.nn.Module):
    """One layer's indexer (see the module); `prefix` is the checkpoint's `model.layers.{i}.self_attn.indexer`."""

    def __init__(self, config: IndexerConfig, hidden: int, q_lora_rank: int, rope_dim: int, prefix: str,
                 dtype: torch.dtype, quantization: str = "none"):
        super().__init__()
        self.config, self.rope_dim = config, rope_dim
        heads, width = config.index_n_heads, config.index_head_dim

        def replicated(name: str, inputs: int, outputs: int) -> ColumnParallelLinear:
            return ColumnParallelLinear(inputs, [RowRange(name=f"{prefix}.{name}", start=0, end=outputs)],
                                        bias=False, dtype=dtype, quantization=quantization)

        self.wq_b = replicated("wq_b", q_lora_rank, heads * width)
        self.wk = replicated("wk", hidden, width)
        self.weights_proj = replicated("weights_proj", hidden, heads)
        self.k_norm = LayerNorm(f"{prefix}.k_norm", width, INDEX_NORM_EPS, dtype)
        self.scale = width**-0.5

    def _rotate(self, x: torch.Tensor, rope_tables) -> torch.Tensor:
        # x [N, heads, D]: its first rope_dim values rotated, as the reference pairs them
        rot, rest = x.split([self.rope_dim, x.shape[-1] - self.rope_dim], dim=-1)
        if self.config.rope_interleave:
            rot = _deinterleave(rot)  # q and k alike: their dot products are the reference's
        return torch.cat((apply_rope(rope_tables, rot), rest), dim=-1)

    def forward(self, hidden: torch.Tensor, q_resid: torch.Tensor, rope_tables) -> tuple[torch.Tensor, ...]:
        """hidden [N, hidden], q_resid [N, q_lora_rank] -> queries [N, Hi, D], keys [N, 1, D] (to cache), head
        weights [N, Hi] float32."""
        n, cfg = hidden.shape[0], self.config
        q = self._rotate(self.wq_b(q_resid).view(n, cfg.index_n_heads, cfg.index_head_dim), rope_tables)
        k = self._rotate(self.k_norm(self.wk(hidden)).unsqueeze(1), rope_tables)
        weights = self.weights_proj(hidden).float() * cfg.index_n_heads**-0.5
        return q, k, weights


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """q [L, Hi, D], weights [L, Hi] float32, keys [T, D] -> scores [L, T] float32 (no mask)."""
    keys = keys.float().t()  # [D, T]
    out = []
    for start in range(0, q.shape[0], SCORE_BLOCK):
        block = torch.relu(torch.matmul(q[start:start + SCORE_BLOCK].float(), keys) * scale)  # [l, Hi, T]
        out.append(torch.matmul(weights[start:start + SCORE_BLOCK].unsqueeze(1), block).squeeze(1))  # [l, T]
    return torch.cat(out) if out else q.new_zeros(0, keys.shape[1], dtype=torch.float32)


def masked_index_scores(q: torch.Tensor, weights: torch.Tensor, index_pool: torch.Tensor, slots: torch.Tensor,
                        key_pos: torch.Tensor, query_pos: torch.Tensor, scale: float) -> torch.Tensor:
    """The scores of the keys at pool `slots` [T] (positions key_pos [T]) for query rows at query_pos [L] ->
    [L, T] float32, -inf where a key comes after the row. The C kernel (cpllm/kernels/index_scores.py: the pool
    read in place, unseen keys skipped) where it applies, else the torch form on a gathered copy of the keys."""
    scores = index_kernel.index_scores(q, weights, index_pool, slots, key_pos, query_pos, scale)
    if scores is None:
        keys = index_pool.index_select(0, slots)[:, 0]  # [T, D]
        scores = index_scores(q, weights, keys, scale)
        scores = scores.masked_fill(key_pos.unsqueeze(0) > query_pos.unsqueeze(1), float("-inf"))
    return scores
