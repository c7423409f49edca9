"""DeepSeek sparse attention (DeepSeek-V3.2, GLM-5) on this rank's heads: MLA (cpllm/layers/mla/attention.py) whose
queries attend only the tokens the indexer (indexer.py) selects, as transformers 5.24 computes it:

    q_resid = q_a_layernorm(q_a_proj(x)); MLA's queries, latents and rotary from it, as MLAAttention's
    score[l, t] over every visible token t <= position(l) (the whole prefix: cached context and new tokens)
    selected(l) = the min(index_topk, T) best scores (topk.py's tie rule); every visible token while the
                  request's prefix is no longer than index_topk (dense)
    out = o_proj(W_UV . softmax over selected(l) of the absorbed scores)

The cache is (latent pool, index pool) (spec.py). Every step stores the rows this rank owns first; then, per
request, over the KV-shard group (DCP: the ranks one request's cache is divided over; a group of one on one rank):
1. each rank scores the index keys it holds (its share of the whole prefix: chunked prefill and prefix hits read
   the cached part from the pool) and keeps its own top-k (score, position) per query row;
2. the candidates are all-gathered (one gather, 8 bytes a candidate) and every rank takes the same global top-k
   of them by the same tie rule (the one-rank path is this with a group of one, so the rule is the same
   everywhere);
3. the queries of the group's heads are all-gathered (every rank's heads must meet every rank's latents), each
   rank attends its selected latent rows (a decode row gathers only its <= index_topk selected rows from the
   pool; a prompt chunk's rows share one key set with a mask), and an all-to-all brings each rank the partials of
   its heads, merged by log-sum-exp.
Every TP rank computes the indexer for all rows (its weights are replicated), so every rank selects alike.

Under PCP, in a step with a prompt chunk (PCP ranks hold different rows), the new latent rows and index keys are
all-gathered over PCP first and each rank stores those it owns (the write rows index that gathered buffer under
every prefill strategy: this layer moves its own rows, whatever the step's strategy). Then:
- replicated KV layout: every PCP rank holds the whole prefix, so its own rows run steps 1-3 over the DCP group;
- sharded KV layout: the prefix is split over PCP x DCP, so the queries (MLA's absorbed ones, the indexer's and its
  head weights) are all-gathered over PCP too: every rank of the KV-shard group then holds the same rows, the
  step's rows of every PCP rank, steps 1-3 run on them unchanged, and each rank keeps its own rows' output.
Decode steps after a PCP prefill need nothing more: their rows are the same over the KV-shard group in both
layouts. docs/context_parallel.md, "DeepSeek sparse attention", counts the cost.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpllm.config.deepseek import MLAConfig
from cpllm.config.sparse_mla import IndexerConfig
from cpllm.context_parallel.merge import merge_attention_partials
from cpllm.context_parallel.metadata import AttentionMetadata, RequestAttention
from cpllm.distributed.comm import all_gather, all_to_all
from cpllm.distributed.parallel_context import ParallelContext
from cpllm.layers.mla.attention import MLAAttention, deinterleave
from cpllm.layers.sparse_mla.backend import SparseMLABackend
from cpllm.layers.sparse_mla.indexer import Indexer, masked_index_scores
from cpllm.layers.sparse_mla.shard import KeyShard
from cpllm.layers.sparse_mla.topk import selected_mask, top_k
from cpllm.model.rope import apply_rope

NEG_INF = float("-inf")
SCORE_ROWS = 256
"""Query rows of a prompt chunk scored and cut to their top-k at once (a [rows, T_local] float32 block)."""
ATTEND_ROWS = 16
"""Query rows of a prompt chunk attended at once (a [rows, heads, T_local] float32 block)."""
SELECTED_FROM = 2
"""A prompt chunk's rows read only their selected latent rows (as decode rows do) where this rank holds at least
this many times index_topk keys of the prefix; below, one masked product over every key it holds costs less
(docs/benchmarks.md, "DeepSeek sparse attention")."""


@dataclass(kw_only=True, frozen=True, slots=True)
class RequestKeys:
    """One request's query rows this rank computes (its own; under PCP's sharded layout in a prompt step, every PCP
    rank's) and the keys of its prefix this rank holds."""

    rows: torch.Tensor
    """[L] its query rows, token order."""
    query_pos: torch.Tensor
    """[L] their positions."""
    key_slots: torch.Tensor
    """[T_local] pool slots of this rank's keys among positions < total, local (= position) order."""
    key_pos: torch.Tensor
    """[T_local] their positions."""
    total: int
    """Positions of the prefix on all ranks together (the last row sees all of them)."""
    single: bool
    """A single new token (a decode row; under PCP its copies on several PCP ranks): its rows read only their
    selected latent rows from the pool."""


def _exchange_candidates(scores: torch.Tensor, positions: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's candidates, scores [N, k] float32 and positions [N, k] int32, in one all-gather of 8 bytes a
    candidate (the positions' bits ride in float32 lanes: a gather copies bytes, so they come back exact) ->
    (scores [N, G k], positions [N, G k] long), the group's candidates of each row."""
    rows, k = scores.shape
    gathered = all_gather(torch.cat((scores, positions.view(torch.float32)), dim=1), group, dim=1)  # [N, G 2k]
    per_rank = gathered.view(rows, -1, 2, k)
    positions = per_rank[:, :, 1].contiguous().view(torch.int32).reshape(rows, -1).long()
    return per_rank[:, :, 0].reshape(rows, -1), positions


class SparseMLAAttention(MLAAttention):
    """One decoder layer's sparse MLA on this TP rank's heads (see the module)."""

    def __init__(self, mla: MLAConfig, indexer: IndexerConfig, hidden: int, num_heads: int, scale: float,
                 prefix: str, parallel: ParallelContext, dtype: torch.dtype, quantization: str = "none",
                 backend: SparseMLABackend | None = None):
        if mla.q_lora_rank is None:
            raise ValueError("sparse MLA needs q_lora_rank: the indexer's queries come from the low-rank query")
        super().__init__(mla, hidden, num_heads, scale, prefix, parallel, dtype, quantization,
                         backend or SparseMLABackend())
        self.kv_shard = parallel.comm("kv_shard")
        """The ranks one request's cache is divided over (DCP, or PCP x DCP under the sharded layout):
        candidates, queries and partials travel over it."""
        self.dcp = parallel.comm("dcp")
        """The DCP group: its ranks hold different heads, gathered for the attention (the PCP ranks of the KV-shard
        group hold the same heads)."""
        self.members = tuple(parallel.member_coords("kv_shard", j) for j in range(self.kv_shard.size))
        """(PCP rank, DCP rank) of each KV-shard group rank: whose rows and heads its partials are."""
        self.pcp = parallel.comm("pcp")
        """The PCP group: a prompt step's new latent rows and index keys (and, sharded, its queries) travel over it."""
        self.shared_rows = parallel.dims.pcp > 1 and not parallel.dims.kv_replicated
        """A prompt step's rows are gathered over PCP (the sharded layout splits the prefix over PCP ranks)."""
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
        q_nope, q_pe, c, k_pe, q_resid = self._project_with_resid(hidden, rope_tables)
        w_uk = self.kv_b[:, :self.mla.qk_nope_head_dim]  # [H, nope, r]
        q_lat = torch.cat((torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1), q_pe), dim=-1)  # [N, H, r+rope]
        latent = torch.cat((c.unsqueeze(1), k_pe), dim=-1)  # [N, 1, r + rope]
        iq, ik, iw = self.index(hidden, q_resid, rope_tables)  # [N, Hi, D], [N, 1, D], [N, Hi]
        slot_of_row = self._store(latent, ik, latent_pool, index_pool, meta)
        shared = self.shared_rows and meta.has_new
        if shared:  # every PCP rank's rows, so that the KV-shard group holds the same rows
            q_lat, iq, iw = (all_gather(x, self.pcp.group) for x in (q_lat, iq, iw))  # [P N, ...]
        sources, offset = (range(self.pcp.size), meta.num_rows) if shared else ((self.pcp.rank,), 0)
        shard = KeyShard.of(meta.kv_layout)
        requests = [self._request_keys(r, slot_of_row, shard, sources, offset) for r in meta.requests]
        requests = [keys for keys in requests if keys.rows.numel()]
        chosen = self._global_top_k(requests, iq, iw, index_pool, self.kv_shard.group)
        out, lse = self._attend(all_gather(q_lat, self.dcp.group, dim=1), requests, chosen, shard, latent_pool)
        out = self._own_partials(out, lse, shared)  # [N, H, r]: this rank's rows and heads
        if keep is not None:
            if keep.numel() == 0:
                return hidden[:0]
            out = out.index_select(0, keep)
        return self._output(self._up_values(out.to(hidden.dtype)))

    def _store(self, latent, ik, latent_pool, index_pool, meta: AttentionMetadata) -> torch.Tensor:
        """Store the new latent rows and index keys this rank owns -> slot_of_row [rows of the buffer the write
        rows index] (-1: a row this rank does not store). In a prompt step under PCP that buffer is the rows of
        every PCP rank (all-gathered here, rank p's rows at p * N), as the metadata lays the writes out."""
        if self.pcp.size > 1 and meta.has_new:
            latent, ik = all_gather(latent, self.pcp.group), all_gather(ik, self.pcp.group)  # [P N, 1, ...]
        backend = self.attn.backend
        backend.store_kv(latent_pool, latent_pool, meta.write_slots, latent, latent, meta.write_rows)
        backend.store_index(index_pool, meta.write_slots, ik, meta.write_rows)
        slot_of_row = torch.full((max(latent.shape[0], 1),), -1, dtype=torch.long, device=latent.device)
        slot_of_row[meta.write_rows] = meta.write_slots
        return slot_of_row

    @staticmethod
    def _request_keys(request: RequestAttention, slot_of_row: torch.Tensor, shard: KeyShard, sources,
                      rows_per_rank: int) -> RequestKeys:
        """The request's query rows held by the PCP ranks `sources` (rank p's rows at p * rows_per_rank) and this
        rank's keys of its prefix: the cached context it holds (a decode row's own token included, where this rank
        owns it), then the new tokens of a prompt chunk it owns."""
        device = slot_of_row.device
        runs = [(p * rows_per_rank + row, start, length) for p in sources
                for row, start, length in request.source_rank_rows[p]]
        rows = torch.cat([torch.arange(row, row + n, device=device) for row, _, n in runs]) if runs else \
            torch.zeros(0, dtype=torch.long, device=device)
        starts = [torch.arange(start, start + n, device=device) for _, start, n in runs]
        query_pos = request.start_pos + (torch.cat(starts) if starts else rows)
        key_slots = request.context_slots.to(device)
        key_pos = shard.positions(torch.arange(key_slots.numel(), device=device))
        if request.num_new > 1:  # a prompt chunk: the tokens this rank owns follow its cached context
            slots = slot_of_row[request.new_kv_rows.to(device)]
            owned = slots >= 0
            key_slots = torch.cat((key_slots, slots[owned]))
            key_pos = torch.cat((key_pos, request.start_pos + torch.arange(request.num_new, device=device)[owned]))
        return RequestKeys(rows=rows, query_pos=query_pos, key_slots=key_slots, key_pos=key_pos,
                           total=request.start_pos + request.num_new, single=request.num_new == 1)

    def _global_top_k(self, requests: list[RequestKeys], iq, iw, index_pool, group) -> dict:
        """Request index (in `requests`) -> (scores [L, K], positions [L, K]) of its rows' global top-k, for the
        requests whose prefix is longer than index_topk (the others attend densely). Steps 1-2 of the module."""
        sparse = [i for i, keys in enumerate(requests) if keys.total > self.index_topk]
        if not sparse:  # the same on every rank: totals are the whole prefix's
            return {}
        k, num_rows = self.index_topk, iq.shape[0]
        cand_scores = torch.full((num_rows, k), NEG_INF, dtype=torch.float32, device=iq.device)
        cand_pos = torch.full((num_rows, k), -1, dtype=torch.int32, device=iq.device)  # positions < 2**31
        for i in sparse:
            keys = requests[i]
            if keys.key_slots.numel() == 0:
                continue  # this rank holds none of the prefix: no candidate
            for start in range(0, keys.rows.numel(), SCORE_ROWS):  # bounds the [rows, T_local] scores
                rows, query_pos = keys.rows[start:start + SCORE_ROWS], keys.query_pos[start:start + SCORE_ROWS]
                scores = masked_index_scores(iq[rows], iw[rows], index_pool, keys.key_slots, keys.key_pos,
                                             query_pos, self.index.scale)  # [l, T_local], the pool read in place
                best, at = top_k(scores, keys.key_pos, k)
                cand_scores[rows, :best.shape[1]] = best
                cand_pos[rows, :at.shape[1]] = at.to(torch.int32)
        cand_scores, cand_pos = _exchange_candidates(cand_scores, cand_pos, group)
        return {i: top_k(cand_scores[requests[i].rows], cand_pos[requests[i].rows], k) for i in sparse}

    def _attend(self, q_all, requests: list[RequestKeys], chosen: dict, shard: KeyShard, latent_pool):
        """Step 3: the DCP group's heads q_all [R, DCP * H, W] over this rank's selected latents -> (out
        [R, DCP * H, r], lse [R, DCP * H]) float32, the partials over the keys this rank holds."""
        backend, r, scale = self.attn.backend, self.mla.kv_lora_rank, self.scale
        num_rows, heads = q_all.shape[0], q_all.shape[1]
        out = torch.zeros(num_rows, heads, r, dtype=torch.float32, device=q_all.device)
        lse = torch.full((num_rows, heads), NEG_INF, dtype=torch.float32, device=q_all.device)
        for i, keys in enumerate(requests):
            num_keys = keys.key_slots.numel()
            if num_keys == 0:
                continue  # no key of this request here: its partial stays (0, -inf)
            for start in range(0, keys.rows.numel(), ATTEND_ROWS):  # bounds the [rows, heads, T_local] scores
                rows = keys.rows[start:start + ATTEND_ROWS]
                q, query_pos = q_all[rows], keys.query_pos[start:start + ATTEND_ROWS]
                if i not in chosen:  # dense: every visible key
                    visible = keys.key_pos.unsqueeze(0) <= query_pos.unsqueeze(1)
                    o, l = backend.attend_masked(q, latent_pool, keys.key_slots, visible, scale, r)
                else:
                    scores, positions = (x[start:start + ATTEND_ROWS] for x in chosen[i])
                    mine = (scores > NEG_INF) & shard.owned(positions.clamp(min=0))
                    local = shard.local_index(positions.clamp(min=0)).clamp(max=num_keys - 1)  # [l, K]
                    if keys.single or num_keys >= SELECTED_FROM * self.index_topk:
                        # a decode row, or a prompt row of a long prefix: only its selected rows are read from the
                        # pool, not every key this rank holds under a mask
                        o, l = backend.attend_selected(q, latent_pool, keys.key_slots[local], mine, scale, r)
                    else:
                        visible = selected_mask(local, mine, num_keys)
                        o, l = backend.attend_masked(q, latent_pool, keys.key_slots, visible, scale, r)
                out[rows], lse[rows] = o, l
        return out, lse

    def _own_partials(self, out: torch.Tensor, lse: torch.Tensor, shared: bool) -> torch.Tensor:
        """The partials (out [R, DCP * H, r], lse [R, DCP * H]) of every KV-shard rank -> this rank's rows and
        heads merged [N, H, r]. Group rank j, at (PCP rank p, DCP rank d), gets the heads of d of its own rows: the
        rows of p where the rows were gathered over PCP (`shared`, R = P N), else all R (the same rows everywhere)."""
        if self.kv_shard.size == 1:
            return out
        num_rows, heads, r = out.shape
        own, blocks = heads // self.dcp.size, self.pcp.size if shared else 1
        out = out.view(blocks, num_rows // blocks, self.dcp.size, own, r)
        lse = lse.view(blocks, num_rows // blocks, self.dcp.size, own)
        take = [(p if shared else 0, d) for p, d in self.members]
        outs = all_to_all(torch.stack([out[p, :, d] for p, d in take]), self.kv_shard.group)  # [G, N, H, r]
        lses = all_to_all(torch.stack([lse[p, :, d] for p, d in take]), self.kv_shard.group)  # [G, N, H]
        return merge_attention_partials(outs, lses)[0]
