"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2, GLM-4.7-Flash) on this rank's heads, over the latent pool.

The projections, as transformers computes them (H heads, r = kv_lora_rank):
    q        = q_proj(x), or q_b_proj(RMSNorm(q_a_proj(x)))        [N, H, nope + rope] -> q_nope | q_pe
    c | k_pe = kv_a_proj_with_mqa(x)                               [N, r + rope]; c = RMSNorm(c) (eps 1e-6)
    q_pe, k_pe rotated (k_pe one key for all heads); rotary pairs interleaved (0, 1), (2, 3) in DeepSeek's layout
    k_nope | v = kv_b_proj(c) per head                             [N, H, nope + v]
    out      = o_proj(softmax(q . k * scale) v)                    scale = (nope + rope) ** -0.5 (x YaRN's mscale^2)
The cache holds c | k_pe per token (the latent, `r + rope` wide), never the per-head keys and values.

Two exact forms:
- absorbed (`forward`: decode, the cached context of every step, and prefill under PCP): kv_b_proj's key rows
  W_UK [H, nope, r] are folded into each query,
  q_lat = (q_nope W_UK) | q_pe [N, H, r + rope], which attends the latent rows as multi-query attention (keys and
  values both the latent; its first r columns are the value); the output's first r columns times W_UV [H, v, r]
  per head are the heads' outputs. It reads the cache as it is, through PagedCPAttention with the MLA backend
  (backend.py), under every plan the CP layer has.
- expanded (the new tokens of a prefill step on one PCP rank, `_expanded_prefill`; `forward_expanded` runs a
  whole sequence this way, as the reference does): the keys and values of every head built from the latents
  (`expand`), attended with key width nope + rope and value width v. It wins for a chunk of many tokens (0.39 s
  against 0.52 s at 512 tokens, one layer of DeepSeek-V2-Lite's shape), the absorbed form for decode (about 40x
  at 2K context: it never expands the cache). A prefill step's cached context still goes through the CP layer
  absorbed (`PagedCPAttention.context_partial`), so under DCP the other ranks' heads meet this rank's latents.
Interleaved rotary pairs are taken apart (evens, then odds) before the rotate-half rotary of cpllm/model/rope.py,
in q and k alike, so their dot products are the reference's.
TP splits the heads (q, kv_b_proj rows, o_proj columns); the latent projection and the cache are replicated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cpllm.config.deepseek import MLAConfig
from cpllm.context_parallel.attention import PagedCPAttention
from cpllm.context_parallel.backend import AttentionBackend
from cpllm.context_parallel.merge import merge_two
from cpllm.context_parallel.metadata import AttentionMetadata
from cpllm.layers.mla.backend import MLAPagedBackend
from cpllm.context_parallel.plan import StepPath
from cpllm.distributed.parallel_context import ParallelContext
from cpllm.model.layers import ColumnParallelLinear, RMSNorm, RowParallelLinear, RowRange
from cpllm.model.loaders.loader import WeightSource
from cpllm.model.rope import apply_rope

LATENT_NORM_EPS = 1e-6
"""Epsilon of q_a_layernorm and kv_a_layernorm: transformers' RMSNorm default, not config.rms_norm_eps."""


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    # [..., d] with rotary pairs (0, 1), (2, 3), ... -> [..., d] evens then odds: pairs (i, i + d/2)
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class MLAAttention(torch.nn.Module):
    """One decoder layer's MLA on this TP rank's heads (see the module)."""

    def __init__(self, mla: MLAConfig, hidden: int, num_heads: int, scale: float, prefix: str,
                 parallel: ParallelContext, dtype: torch.dtype, quantization: str = "none",
                 backend: AttentionBackend | None = None):
        """`scale`: the softmax scale (MLAConfig.softmax_scale); `prefix`: the checkpoint's
        `model.layers.{i}.self_attn`."""
        super().__init__()
        tp = parallel.comm("tp")
        if num_heads % tp.size:
            raise ValueError(f"num_attention_heads={num_heads} is not divisible by tensor_parallel_size={tp.size}")
        self.mla, self.scale, self.tp = mla, scale, tp
        self.heads = heads = num_heads // tp.size
        first = tp.rank * heads
        qk, r = mla.qk_head_dim, mla.kv_lora_rank

        def linear(name: str, width: int, rows: tuple[int, int]) -> ColumnParallelLinear:
            return ColumnParallelLinear(width, [RowRange(name=f"{prefix}.{name}", start=rows[0], end=rows[1])],
                                        bias=False, dtype=dtype, quantization=quantization)

        my_q_rows = (first * qk, (first + heads) * qk)
        self.q_proj = self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        if mla.q_lora_rank is None:
            self.q_proj = linear("q_proj", hidden, my_q_rows)
        else:
            self.q_a_proj = linear("q_a_proj", hidden, (0, mla.q_lora_rank))  # replicated
            self.q_a_layernorm = RMSNorm(f"{prefix}.q_a_layernorm.weight", mla.q_lora_rank, LATENT_NORM_EPS, dtype)
            self.q_b_proj = linear("q_b_proj", mla.q_lora_rank, my_q_rows)
        self.kv_a_proj = linear("kv_a_proj_with_mqa", hidden, (0, mla.latent_width))  # replicated
        self.kv_a_layernorm = RMSNorm(f"{prefix}.kv_a_layernorm.weight", r, LATENT_NORM_EPS, dtype)
        self.kv_b_name = f"{prefix}.kv_b_proj.weight"
        per_head = mla.qk_nope_head_dim + mla.v_head_dim
        self.kv_b_rows = (first * per_head, (first + heads) * per_head)
        # [H_local, nope + v, r] as stored: the expanded form's projection, and W_UK | W_UV of the absorbed form
        self.kv_b = torch.nn.Parameter(torch.empty(heads, per_head, r, dtype=dtype), requires_grad=False)
        self.o_proj = RowParallelLinear(f"{prefix}.o_proj", num_heads * mla.v_head_dim, hidden, parallel, dtype,
                                        quantization)
        self.attn = PagedCPAttention(parallel, scale=scale, backend=backend or MLAPagedBackend())
        self.expanded_prefill = True
        """Prefill steps on one PCP rank take the expanded form for their new tokens (False: the absorbed form, as
        every other step; both exact). Under PCP the absorbed form runs, so the latents travel, not the heads."""
        self.cache_values_per_token = mla.latent_width
        """Values this layer caches per token (one latent row, the same on every TP rank; the start-up log's)."""

    def load(self, source: WeightSource) -> None:
        # the projections and norms load themselves (the model loads every module with a `load`)
        if not source.has(self.kv_b_name) and source.has(self.kv_b_name.replace("kv_b_proj", "k_b_proj")):
            self.kv_b.copy_(self._joined_kv_b(source))
            return
        w = source.get(self.kv_b_name, dim=0, start=self.kv_b_rows[0], end=self.kv_b_rows[1], dtype=self.kv_b.dtype)
        self.kv_b.copy_(w.view(self.kv_b.shape))

    def _joined_kv_b(self, source: WeightSource) -> torch.Tensor:
        """kv_b_proj's rows of this rank's heads [H_local, nope + v, r] from llama.cpp's split form (a GGUF file:
        k_b [H, r, nope], the key rows transposed, and v_b [H, v, r]; cpllm/model/loaders/gguf_deepseek.py)."""
        first = self.kv_b_rows[0] // self.kv_b.shape[1]
        dtype = self.kv_b.dtype
        k_b = source.get(self.kv_b_name.replace("kv_b_proj", "k_b_proj"), dtype=dtype)[first:first + self.heads]
        v_b = source.get(self.kv_b_name.replace("kv_b_proj", "v_b_proj"), dtype=dtype)[first:first + self.heads]
        return torch.cat((k_b.transpose(1, 2), v_b), dim=1)

    def _project(self, hidden: torch.Tensor, rope_tables) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                    torch.Tensor]:
        # hidden [N, hidden] -> q_nope [N, H, nope], q_pe [N, H, rope] (rotated), c [N, r] (normed), k_pe [N, 1, rope]
        n, mla = hidden.shape[0], self.mla
        q = self.q_proj(hidden) if self.q_proj is not None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q_nope, q_pe = q.view(n, self.heads, mla.qk_head_dim).split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], -1)
        c, k_pe = self.kv_a_proj(hidden).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        c = self.kv_a_layernorm(c.contiguous())
        k_pe = k_pe.unsqueeze(1)
        if not mla.rotary:  # Kimi Linear: no position enters the attention
            return q_nope, q_pe, c, k_pe
        if mla.rope_interleave:
            q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
        return q_nope, apply_rope(rope_tables, q_pe), c, apply_rope(rope_tables, k_pe)

    def _output(self, out: torch.Tensor) -> torch.Tensor:
        # out [N, H, v] -> [N, hidden] (summed over TP by o_proj)
        return self.o_proj(out.reshape(out.shape[0], self.heads * self.mla.v_head_dim))

    def forward(self, hidden: torch.Tensor, rope_tables, kv_cache, meta: AttentionMetadata,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        """The absorbed form over the latent pool `kv_cache[0]` (kv_cache is (pool, pool)); `keep` as in
        LlamaAttention (the rows whose output is needed; every row's latent is stored and attended)."""
        mla, r = self.mla, self.mla.kv_lora_rank
        q_nope, q_pe, c, k_pe = self._project(hidden, rope_tables)
        w_uk = self.kv_b[:, :mla.qk_nope_head_dim]  # [H, nope, r]
        q_c = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [N, H, r]
        q_lat = torch.cat((q_c, q_pe), dim=-1)  # [N, H, r + rope]
        latent = torch.cat((c.unsqueeze(1), k_pe), dim=-1)  # [N, 1, r + rope]
        pool = kv_cache[0]
        if self.expanded_prefill and meta.plan.path is StepPath.PREFILL and self.attn.pcp.size == 1:
            heads_out = self._expanded_prefill(q_nope, q_pe, q_lat, latent, pool, meta)  # [N, H, v]
            if keep is not None:
                if keep.numel() == 0:
                    return hidden[:0]
                heads_out = heads_out.index_select(0, keep)
            return self._output(heads_out)
        out = self.attn(q_lat, latent, latent, pool, pool, meta)[..., :r]  # [N, H, r]: the value columns
        if keep is not None:
            if keep.numel() == 0:
                return hidden[:0]  # no row wanted: no projection (nor its all-reduce) on any rank
            out = out.index_select(0, keep)
        return self._output(self._up_values(out))

    def _up_values(self, out: torch.Tensor) -> torch.Tensor:
        # out [N, H, r] (attention over the latents' value columns) -> [N, H, v]: each head's W_UV after attention
        w_uv = self.kv_b[:, self.mla.qk_nope_head_dim:]  # [H, v, r]
        return torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2).to(out.dtype)).transpose(0, 1)

    def _expanded_prefill(self, q_nope, q_pe, q_lat, latent, pool, meta: AttentionMetadata) -> torch.Tensor:
        """A prefill step on one PCP rank: the new tokens attend each other in the expanded form (every head's keys
        and values built from their latents, as the reference computes them: faster than the absorbed form for a
        chunk of many tokens), the cached context in the absorbed form through the CP layer (its queries gathered
        over the KV-shard group under DCP, where other ranks' heads meet this rank's latents); W_UV is linear, so
        the context partial taken to the heads' values merges exactly with the new tokens' -> [N, H, v]."""
        backend, r = self.attn.backend, self.mla.kv_lora_rank
        if pool.dtype != latent.dtype:  # a narrower --kv-cache-dtype: attend the rounded latents, as read back
            latent = latent.to(pool.dtype).to(latent.dtype)
        backend.store_kv(pool, pool, meta.write_slots, latent, latent, meta.write_rows)  # this rank's own rows
        q = torch.cat((q_nope, q_pe), dim=-1)  # [N, H, nope + rope]
        # the new tokens' piece (a single token attends its context, itself included, stored above)
        k_new, v_new = self.expand(latent)  # [N, H, nope + rope], [N, H, v]: a prefill step has several new tokens
        out, lse = self.attn.new_token_partial(q, k_new, v_new, meta)  # [N, H, v] float32
        if meta.has_context:
            o_ctx, lse_ctx = self.attn.context_partial(q_lat, pool, pool, meta)  # [N, H, r + rope] float32
            out, lse = merge_two(out, lse, self._up_values(o_ctx[..., :r].float()), lse_ctx)
        return out.to(q.dtype)

    def expand(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every head's keys and values from latent rows [S, 1, r + rope] -> k [S, H, nope + rope], v [S, H, v]."""
        mla = self.mla
        c, k_pe = latent[:, 0].split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        kv = F.linear(c, self.kv_b.view(-1, mla.kv_lora_rank)).view(-1, self.heads, self.kv_b.shape[1])
        k_nope, v = kv.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=-1)  # [S, H, nope], [S, H, v]
        k = torch.cat((k_nope, k_pe.unsqueeze(1).expand(-1, self.heads, -1)), dim=-1)
        return k, v.contiguous()

    def forward_expanded(self, hidden: torch.Tensor, rope_tables, pool: torch.Tensor, new_slots: torch.Tensor,
                         context_slots: torch.Tensor | None = None) -> torch.Tensor:
        """The reference's form for one sequence on one rank: hidden [T, hidden] (positions P..P+T-1 in
        `rope_tables`), its new latents stored at `new_slots` [T], its cached context read at `context_slots` [P]
        (None: none); every head's keys and values expanded from the latents; the new tokens attend each other
        causally and the context wholly, the two partials merged exactly -> [T, hidden]."""
        q_nope, q_pe, c, k_pe = self._project(hidden, rope_tables)
        latent = torch.cat((c.unsqueeze(1), k_pe), dim=-1)  # [T, 1, r + rope]
        backend = self.attn.backend
        backend.store_kv(pool, pool, new_slots, latent, latent, torch.arange(hidden.shape[0]))
        q = torch.cat((q_nope, q_pe), dim=-1)  # [T, H, nope + rope]
        out, lse = backend.attend(q, *self.expand(latent), self.scale, True)  # [T, H, v]
        if context_slots is not None and context_slots.numel():
            cached, _ = backend.context_keys(pool, pool, context_slots, latent.dtype)  # [P, 1, r + rope]
            out, lse = merge_two(out, lse, *backend.attend(q, *self.expand(cached), self.scale, False))
        return self._output(out.to(hidden.dtype))
