"""DeepSeek sparse attention (DeepSeek-V3.2, GLM-5) on this rank's heads: MLA (cpllm/layers/mla/attention.py) whose
queries attend only the tokens the indexer (indexer.py) selects, as transformers 5.24 computes it:

    q_resid = q_a_layernorm(q_a_proj(x)); MLA's queries, latents and rotary from it, as MLAAttention's
    score[l, t] over every visible token t <= position(l) (the whole prefix: cached context and new tokens)
    selected(l) = the min(index_topk, T) best scores (topk.py's tie rule); every visible token while the row's
                  context is no longer than index_topk (dense)
    out = o_proj(W_UV . softmax over selected(l) of the absorbed scores)

The cache is (latent pool, index pool) (spec.py). Every step stores its rows' latents and index keys first, then
each request's rows score the index keys of its whole prefix (chunked prefill and prefix hits read the cached part
from the pool) and attend their selected latent rows in the absorbed form (backend.py): a decode row gathers only
its <= index_topk selected rows from the pool, a prompt chunk's rows share one key set with a mask.

One rank holds every position of a request (decode_context_parallel_size and prefill_context_parallel_size are 1:
cpllm/config/sparse_mla.py refuses the others); TP splits the heads as MLA does and every TP rank selects alike.
"""

from __future__ import annotations

import torch

from cpllm.config.deepseek import MLAConfig
from cpllm.config.sparse_mla import IndexerConfig
from cpllm.context_parallel.metadata import AttentionMetadata, RequestAttention
from cpllm.layers.mla.attention import MLAAttention, deinterleave
from cpllm.layers.sparse_mla.backend import SparseMLABackend
from cpllm.layers.sparse_mla.indexer import Indexer, index_scores
from cpllm.layers.sparse_mla.topk import selected_mask, top_k
from cpllm.distributed.parallel_context import ParallelContext
from cpllm.model.rope import apply_rope


class SparseMLAAttention(MLAAttention):
    """One decoder layer's sparse MLA on this TP rank's heads (see the module)."""

    def __init__(self, mla: MLAConfig, indexer: IndexerConfig, hidden: int, num_heads: int, scale: float,
                 prefix: str, parallel: ParallelContext, dtype: torch.dtype, quantization: str = "none",
                 backend: SparseMLABackend | None = None):
        if mla.q_lora_rank is None:
            raise ValueError("sparse MLA needs q_lora_rank: the indexer's queries come from the low-rank query")
        if parallel.dims.pcp > 1 or parallel.dims.dcp > 1:
            raise ValueError(f"sparse MLA on prefill_context_parallel_size={parallel.dims.pcp}, "
                             f"decode_context_parallel_size={parallel.dims.dcp}: only 1 and 1 are built")
        super().__init__(mla, hidden, num_heads, scale, prefix, parallel, dtype, quantization,
                         backend or SparseMLABackend())
        self.index = Indexer(indexer, hidden, mla.q_lora_rank, mla.qk_rope_head_dim, f"{prefix}.indexer", dtype,
                             quantization)
        self.index_topk = indexer.index_topk
        self.cache_values_per_token = mla.latent_width + indexer.index_head_dim
        """Values this layer caches per token: the latent row and the index key."""

    def _project_with_resid(self, hidden: torch.Tensor, rope_tables):
        # MLAAttention._project, keeping q_resid (the indexer's input) -> q_nope, q_pe, c, k_pe, q_resid
        n, mla = hidden.shape[0], self.mla
        q_resid = self.q_a_layernorm(self.q_a_proj(hidden))  # [N, q_lora_rank]
        q = self.q_b_proj(q_resid)
        q_nope, q_pe = q.view(n, self.heads, mla.qk_head_dim).split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], -1)
        c, k_pe = self.kv_a_proj(hidden).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        c = self.kv_a_layernorm(c.contiguous())
        k_pe = k_pe.unsqueeze(1)
        if mla.rope_interleave:
            q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
        return q_nope, apply_rope(rope_tables, q_pe), c, apply_rope(rope_tables, k_pe), q_resid

    def forward(self, hidden: torch.Tensor, rope_tables, kv_cache, meta: AttentionMetadata,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [N, hidden] -> [N, hidden] (the rows of `keep` only, where given); kv_cache is (latent pool,
        index pool)."""
        latent_pool, index_pool = kv_cache
        r = self.mla.kv_lora_rank
        q_nope, q_pe, c, k_pe, q_resid = self._project_with_resid(hidden, rope_tables)
        w_uk = self.kv_b[:, :self.mla.qk_nope_head_dim]  # [H, nope, r]
        q_lat = torch.cat((torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1), q_pe), dim=-1)  # [N, H, r+rope]
        latent = torch.cat((c.unsqueeze(1), k_pe), dim=-1)  # [N, 1, r + rope]
        iq, ik, iw = self.index(hidden, q_resid, rope_tables)  # [N, Hi, D], [N, 1, D], [N, Hi]
        backend = self.attn.backend
        backend.store_kv(latent_pool, latent_pool, meta.write_slots, latent, latent, meta.write_rows)
        backend.store_index(index_pool, meta.write_slots, ik, meta.write_rows)
        slot_of_row = torch.full((max(meta.num_rows, 1),), -1, dtype=torch.long, device=hidden.device)
        slot_of_row[meta.write_rows] = meta.write_slots  # one rank: the gathered rows are the batch's rows
        out = torch.zeros(hidden.shape[0], self.heads, r, dtype=torch.float32, device=hidden.device)
        for request in meta.requests:
            rows, key_slots, query_pos = self._request_keys(request, slot_of_row)
            if rows.numel():
                out[rows] = self._attend_request(q_lat[rows], iq[rows], iw[rows], query_pos, key_slots,
                                                 latent_pool, index_pool)
        if keep is not None:
            if keep.numel() == 0:
                return hidden[:0]
            out = out.index_select(0, keep)
        return self._output(self._up_values(out.to(hidden.dtype)))

    @staticmethod
    def _request_keys(request: RequestAttention, slot_of_row: torch.Tensor):
        """One request's query rows [L] (token order), the slots of its whole prefix [T] (position order: the
        cached context, then the new tokens of a prompt chunk) and the rows' positions [L]."""
        device = slot_of_row.device
        rows = [torch.arange(ch.row, ch.row + ch.length, device=device) for ch in request.local_chunks]
        rows = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long, device=device)
        starts = [torch.arange(ch.new_start, ch.new_start + ch.length, device=device) for ch in request.local_chunks]
        query_pos = request.start_pos + (torch.cat(starts) if starts else rows)
        key_slots = request.context_slots.to(device)
        if request.num_new > 1:  # a prompt chunk: its own tokens follow the cached context
            key_slots = torch.cat((key_slots, slot_of_row[request.new_kv_rows.to(device)]))
        return rows, key_slots, query_pos

    def _attend_request(self, q_lat, iq, iw, query_pos, key_slots, latent_pool, index_pool) -> torch.Tensor:
        """One request's rows: scores over its prefix, the top-k, attention over it -> [L, H, r] float32."""
        backend, num_keys = self.attn.backend, key_slots.numel()
        key_pos = torch.arange(num_keys, device=key_slots.device)
        visible = key_pos.unsqueeze(0) <= query_pos.unsqueeze(1)  # [L, T] causal
        if num_keys > self.index_topk:  # else every visible key is selected: dense
            scores = index_scores(iq, iw, backend.index_keys(index_pool, key_slots), self.index.scale)
            scores = scores.masked_fill(~visible, float("-inf"))
            top_scores, top_pos = top_k(scores, key_pos, self.index_topk)  # [L, K]
            if q_lat.shape[0] == 1:  # a decode row: only its selected rows are read from the pool
                chosen = top_scores > float("-inf")
                return backend.attend_selected(q_lat, latent_pool, key_slots[top_pos], chosen, self.scale,
                                               self.mla.kv_lora_rank)
            visible = selected_mask(top_pos, top_scores, num_keys)
        return backend.attend_masked(q_lat, latent_pool, key_slots, visible, self.scale, self.mla.kv_lora_rank)
