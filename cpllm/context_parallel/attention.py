"""Attention over a paged, CP-sharded KV cache (docs/context_parallel.md: "Prefill partition",
"Decode", "Exact merge").

For each layer, a rank's queries see two disjoint key sets whose results merge
exactly by log-sum-exp:
- the new tokens of this step (prefill chunks), held across PCP ranks and
  brought together by all-gather or by passing K/V around the PCP ring;
- the cached context, sharded over the CP group (over the DCP group alone under
  the replicated KV layout): queries are gathered over that group, every rank
  attends them to its own shard, and the partial outputs return to their owners
  to be merged.
The pass-Q strategy (pass_q.py) instead moves the queries round the ring for
both key sets, and the step's metadata says which strategy a step uses.
With one rank every collective is skipped and the same code is the plain paged
attention of the single-rank engine.

Steps of single tokens take the path the runner planned (`AttentionMetadata.plan`,
plan.py): one-shard (and compiled) decode, PCP decode, or the general path above.
Every call on this rank's own data (storing K/V, attending rows to keys, decode
rows read from the pools) goes to the layer's `AttentionBackend` (backend.py),
so this module is written once for every attention kind.

Partial outputs are merged and accumulated in float32 whatever the model dtype
(docs/context_parallel.md, "Exact merge"): only the kernels' own outputs are in the model dtype, and
the layer's result is converted to it once, at the end.
"""

from __future__ import annotations

import dataclasses

import torch

from cpllm.context_parallel.backend import AttentionBackend
from cpllm.context_parallel.merge import accumulate as _accumulate
from cpllm.context_parallel.merge import accumulator_dtype, apply_sinks, merge_attention_partials, merge_two
from cpllm.context_parallel.metadata import AttentionMetadata, RequestAttention
from cpllm.context_parallel.partition import joined_key_runs, key_runs
from cpllm.context_parallel.pass_q import pass_q_attention
from cpllm.context_parallel.plan import StepPath
from cpllm.distributed.comm import all_gather, all_gather_rows, all_to_all, ring_exchange
from cpllm.distributed.parallel_context import ParallelContext


_ONE_SHARD, _COMPILED, _PCP_DECODE = StepPath.ONE_SHARD, StepPath.COMPILED, StepPath.PCP_DECODE


def _default_backend() -> AttentionBackend:
    from cpllm.layers.registry import attention_backend  # the registry's default kind (import: no cycle)
    return attention_backend()


class PagedCPAttention(torch.nn.Module):
    """Stores this rank's share of the new K/V and returns attention outputs for its query rows; the attention on
    this rank is the backend's (backend.py), every collective and merge is this layer's.

    `mods` (a score modifier: a sliding window, soft-capping) applies to every piece on its own keys
    (cpllm/layers/window/modifier.py); `sinks` ([Hq] float32, one logit per local query head) join each head's
    denominator once, after the last merge (merge.py `apply_sinks`). Without any of them the layer runs exactly
    its plain paths."""

    def __init__(self, parallel: ParallelContext, scale: float, backend: AttentionBackend | None = None, *,
                 mods=None):
        super().__init__()
        self.parallel, self.scale = parallel, scale
        """The rank's parallel context (cpllm/distributed/parallel_context.py): the groups this layer talks over."""
        self.pcp, self.cp, self.kv = parallel.comm("pcp"), parallel.comm("cp"), parallel.comm("kv_shard")
        """The PCP group (the other parts of each prompt chunk), the cp group (PCP x DCP ranks sharing this rank's
        KV heads) and the KV-shard group (the ranks one request's cached context is divided over: the cp group, or
        the DCP group under the replicated layout), read in every step."""
        pieces = [parallel.member_coords("kv_shard", piece) for piece in range(self.kv.size)]
        self.piece_pcp_rank = tuple(pcp_rank for pcp_rank, _ in pieces)
        """The PCP rank whose rows piece `piece` of a query gather over the KV-shard group holds."""
        self.piece_dcp_rank = tuple(dcp_rank for _, dcp_rank in pieces)
        """The DCP rank of piece `piece`'s sender (which query heads it holds)."""
        self.backend = backend if backend is not None else _default_backend()
        self.mods = mods
        """The layer's score modifier (cpllm/layers/window/modifier.py `ScoreMods`: a window, a soft-cap), asked
        which keys each piece keeps and how to attend it; None: the plain paths."""
        self._decode_kwargs = {} if mods is None else mods.decode_kwargs
        self.causal_offsets = getattr(self.backend, "causal_offsets", False)
        """The backend's `attend` takes `causal_offset=`: a run and the keys just before it go in one call."""

    def forward(self, q, k, v, k_pool, v_pool, meta: AttentionMetadata,
                sinks: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """out [N, Hq, D] in q's dtype, or in `out_dtype` (bfloat16: what the caller rounds it to next, a bf16
        GEMM's input) where one backend call gives the step's output with no merge after it and the backend
        writes it so (`narrow_output`): the same bits, without a float32 output written and read back."""
        # q [N, Hq, D]; k, v [N, Hkv, D]; k_pool, v_pool [num_slots, Hkv, D]; sinks [Hq] float32
        if self.mods is not None or sinks is not None:
            if sinks is not None and tuple(sinks.shape) != (q.shape[1],):
                raise ValueError(f"sinks {tuple(sinks.shape)}: want one logit per local query head, [{q.shape[1]}]")
            out, lse = self._scored(q, k, v, k_pool, v_pool, meta, sinks)
            return (out if sinks is None else apply_sinks(out.float(), lse, sinks)).to(q.dtype)
        plan = meta.plan.path  # the runner's (plan.py); these decode paths read the new K/V only from the pools
        if plan is _ONE_SHARD or plan is _COMPILED:
            return self._one_shard_decode(q, k, v, k_pool, v_pool, meta)
        if plan is _PCP_DECODE:
            return self._pcp_decode(q, k, v, k_pool, v_pool, meta)
        out, _ = self._general(q, k, v, k_pool, v_pool, meta, out_dtype)
        return out if out.dtype == out_dtype else out.to(q.dtype)

    def _general(self, q, k, v, k_pool, v_pool, meta: AttentionMetadata, out_dtype: torch.dtype | None = None):
        """The path of steps with prompt chunks (and of single tokens the runner did not plan otherwise): new tokens
        over PCP by the step's strategy, then the cached context over the KV-shard group -> (out, lse) of the last
        merge. The layer's score modifiers (`mods`, None for a plain layer) restrict each piece. `out_dtype`: as
        `forward` (offered to the gathered path's one call where no context merge follows)."""
        if k_pool.dtype != k.dtype:
            # A narrower --kv-cache-dtype: new tokens attend to the rounded K/V too, exactly what they read back from
            # the pool in later steps, so outputs do not depend on which tokens shared a chunk (nor on the layout).
            k, v = k.to(k_pool.dtype).to(k.dtype), v.to(v_pool.dtype).to(v.dtype)
        strategy = meta.strategy if meta.strategy is not None else self.parallel.prefill_strategy
        if strategy == "pass-q" and self.pcp.size > 1 and meta.has_new:
            if meta.pass_q is None:
                raise ValueError("strategy 'pass-q' needs the step's K/V store plan: build the metadata with "
                                 "a plan of strategy 'pass-q' (plan.py `plan_step`)")
            return pass_q_attention(self.parallel, self.backend, self.scale, q, k, v, k_pool, v_pool, meta, self.mods)
        if strategy == "ring" and self.pcp.size > 1 and meta.has_new:
            out, lse = _empty_partials(q)
            self._ring_new_tokens(q, k, v, k_pool, v_pool, meta, out, lse)
        else:
            narrow = None if meta.has_context or not getattr(self.backend, "narrow_output", False) else out_dtype
            out, lse = self._gathered_new_tokens(q, k, v, k_pool, v_pool, meta, narrow)
        if meta.has_context:
            o_ctx, lse_ctx = self._context(q, k_pool, v_pool, meta)
            out, lse = merge_two(out, lse, o_ctx, lse_ctx)
        return out, lse

    def _scored(self, q, k, v, k_pool, v_pool, meta: AttentionMetadata, sinks):
        """forward's paths for a layer with a window, a soft-cap or sinks -> (out, lse) of the last merge: the same
        collectives, each piece restricted to its keys in the window, the decode rows read through their
        in-window view (no mask), masked or soft-capped pieces attended by the modifier itself."""
        plan = meta.plan.path
        if plan.fused or plan is _COMPILED:
            raise ValueError(f"plan {plan.value!r} runs kernels that know no window, soft-cap or sink: plan the "
                             "steps of such a model eagerly (its family builds no fused decode layers and refuses "
                             "--compile-decode)")
        if self.mods is not None and meta.decode is not None:
            meta = dataclasses.replace(meta, decode=self.mods.decode_view(meta))
        if plan is _ONE_SHARD:
            return self._one_shard_scored(q, k, v, k_pool, v_pool, meta, whole=sinks is None)
        if plan is _PCP_DECODE:
            self.backend.store_kv(k_pool, v_pool, meta.write_slots, k, v, meta.write_rows)
            return self._replicated_query_context(q, k_pool, v_pool, meta)
        return self._general(q, k, v, k_pool, v_pool, meta)

    def _one_shard_scored(self, q, k, v, k_pool, v_pool, meta: AttentionMetadata, whole: bool):
        """`_one_shard_decode` on the in-window view; (out, lse) where sinks need the lse (`whole` False) or a
        soft-cap needs the scored path, else the whole-context call (lse then unused)."""
        decode = meta.decode
        self.backend.store_kv(k_pool, v_pool, meta.write_slots, k, v, meta.write_rows)
        lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
        if decode is None:  # replicated layout: the other PCP copies compute this step's few tokens
            return torch.zeros_like(q), lse
        rows = decode.rows[self.pcp.rank]  # [B]
        q_rows = q if rows.numel() == meta.num_rows else q.index_select(0, rows)
        if whole and not self._decode_kwargs:  # no lse wanted and nothing the whole-context call cannot apply
            o, lse_rows = self.backend.attend_decode_whole(q_rows, k_pool, v_pool, decode, self.scale), None
        else:
            o, lse_rows = self.backend.attend_decode(q_rows, k_pool, v_pool, decode, self.scale,
                                                     every_row_sees_a_key=True, **self._decode_kwargs)
        out = torch.zeros(q.shape, dtype=o.dtype, device=q.device)  # padding rows stay (0, -inf)
        out.index_copy_(0, rows, o)
        if lse_rows is not None:
            lse.index_copy_(0, rows, lse_rows.float())
        return out, lse

    def _one_shard_decode(self, q, k, v, k_pool, v_pool, meta: AttentionMetadata) -> torch.Tensor:
        """A step of single tokens whose whole context sits in this rank's pools (one rank, or TP alone): store the
        new K/V, then one attention call over the context read out of the pools with index_select (several times
        faster than advanced indexing here). The general path computes the same numbers: its merge with the empty
        new-token partial multiplies by exactly 1."""
        decode = meta.decode
        self.backend.store_kv(k_pool, v_pool, meta.write_slots, k, v, meta.write_rows)
        if decode is None:  # replicated layout: the other PCP copies compute this step's few tokens
            return torch.zeros_like(q)
        rows = decode.rows[self.pcp.rank]  # [B]
        whole = rows.numel() == meta.num_rows  # rows run 0..N-1 in order: every row is a decode row here
        o = self.backend.attend_decode_whole(q if whole else q.index_select(0, rows), k_pool, v_pool, decode,
                                             self.scale)
        if whole:
            return o
        out = torch.zeros_like(q)  # padding rows (a PCP rank holding fewer single tokens) stay 0
        return out.index_copy_(0, rows, o)

    def _pcp_decode(self, q, k, v, k_pool, v_pool, meta: AttentionMetadata) -> torch.Tensor:
        """A step of single tokens over PCP without DCP (sharded layout): every PCP rank holds every query at the
        same rows; each stores the new K/V it owns, attends all queries to its shard, and one all-gather brings the
        partials to merge. The general path computes the same numbers, plus a merge with the empty new-token
        partial that multiplies by exactly 1."""
        self.backend.store_kv(k_pool, v_pool, meta.write_slots, k, v, meta.write_rows)
        out, _ = self._replicated_query_context(q, k_pool, v_pool, meta)
        return out.to(q.dtype)

    def _gathered_new_tokens(self, q, k, v, k_pool, v_pool, meta,
                             out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Every new token's K/V on every PCP rank, stored, and each local run attended to them -> (out, lse);
        rows of no run (single tokens) stay (0, -inf). `out_dtype`: the one call's output in it (its backend
        writes it so)."""
        k_all, v_all, rows = k, v, meta.write_rows  # only single tokens: every PCP rank holds them at the same rows
        if meta.has_new:
            in_order = self._gather_in_order(k, v, meta)
            if in_order is not None:
                k_all, v_all, rows, meta = in_order
            else:
                moved = tuple(all_gather(part, self.pcp.group) for part in self.backend.rows_to_move(k, v))
                k_all, v_all = self.backend.rows_moved(moved)
        self.backend.store_kv(k_pool, v_pool, meta.write_slots, k_all, v_all, rows)  # in the pools' dtype
        whole = self._one_call(meta, q.shape[0])
        if whole is not None:  # one prompt's runs lead the rows: one call's result is the step's, as it comes
            keys = _new_keys(whole.request, 0, whole.end)
            return self._attend_one_call(q, _rows(k_all, keys), _rows(v_all, keys), whole, out_dtype)
        runs = [r for r in meta.requests if r.num_new > 1]
        if self.mods is None and sum(c.length for r in runs for c in r.local_chunks) == q.shape[0]:
            out, lse = _unset_partials(q)  # the runs write every row (they are disjoint): nothing to clear
        else:
            out, lse = _empty_partials(q)
        for request in runs:
            self._new_token_attention(q, k_all, v_all, request, out, lse)
        return out, lse

    def _gather_in_order(self, k, v, meta: AttentionMetadata):
        """(keys, values, the store's rows into them, meta reading them) where a step's one request's new K/V can be
        gathered straight into position order: every PCP rank writes its runs at their positions of one host's
        shared buffers, which every rank then reads in place (the store, the attention's keys as a slice) with no
        concatenation and no reordering copy. None on every rank alike where not: several requests in the step,
        no shared memory, or rows past its buffers (the all-gather then runs)."""
        if len(meta.requests) != 1 or meta.requests[0].num_new < 2:
            return None
        request, n = meta.requests[0], meta.num_rows
        placements = list(request.source_rank_rows[self.pcp.rank])  # (row, new_start, length): rows to positions
        moved = all_gather_rows(self.backend.rows_to_move(k, v), placements, request.num_new, self.pcp.group)
        if moved is None:
            return None
        # the store's rows: each gathered row (rank-major, as write_rows count them) at its token's position
        position = torch.empty(self.pcp.size * n, dtype=torch.long)
        for rank, rank_runs in enumerate(request.source_rank_rows):
            for row, new_start, length in rank_runs:
                position[rank * n + row: rank * n + row + length] = torch.arange(new_start, new_start + length)
        in_order = dataclasses.replace(request, new_kv_rows=torch.arange(request.num_new), new_kv_first=0)
        return (*self.backend.rows_moved(moved), position[meta.write_rows],
                dataclasses.replace(meta, requests=(in_order,)))

    def _one_call(self, meta: AttentionMetadata, rows: int) -> OneCall | None:
        """The one backend call that attends the step's rows to the first new keys of one request in position order,
        each row seeing its own position's prefix: one run (an int offset) or several runs (a tensor of per-row
        offsets, where the backend takes one); rows after the runs (padding, single tokens) see key 0 in the call
        and are reset to (0, -inf) after it. None where the runs need calls of their own."""
        if not self.causal_offsets or self.mods is not None:
            return None
        found = _runs_of_all_rows(meta, rows)
        if found is None:
            return None
        request, chunks, covered = found
        end = max(c.new_start + c.length for c in chunks)
        if len(chunks) == 1 and covered == rows:
            return OneCall(request=request, end=end, offset=chunks[0].new_start, covered=covered)
        if not getattr(self.backend, "row_causal_offsets", False):
            return None
        # row r of a run at rows [row, row + length) is new token new_start + (r - row); a row past them sees key 0
        offsets = torch.cat([torch.full((c.length,), c.new_start - c.row, dtype=torch.int32) for c in chunks]
                            + [-torch.arange(covered, rows, dtype=torch.int32)])
        return OneCall(request=request, end=end, offset=offsets, covered=covered)

    def _attend_one_call(self, q, keys, values, call: OneCall,
                         out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`call` on the keys and values of its request's first `call.end` new tokens in order -> (out, lse); out in
        `out_dtype` where the backend wrote it so, else in the accumulator dtype."""
        narrow = {} if out_dtype is None else {"out_dtype": out_dtype}
        out, lse = self.backend.attend(q, keys, values, self.scale, True, causal_offset=call.offset, **narrow)
        out, lse = out if out.dtype == out_dtype else out.to(accumulator_dtype(q.dtype)), lse.float()
        if call.covered < q.shape[0]:  # rows of no run: the partials of no key, as every other path leaves them
            out[call.covered:] = 0
            lse[call.covered:] = float("-inf")
        return out, lse

    def _new_token_attention(self, q, k_all, v_all, request: RequestAttention, out, lse) -> None:
        """Each local run [s, s+n) sees new keys [0, s) unmasked plus itself causally (head-tail safe): one call with
        a causal offset where the backend takes one, else two calls merged."""
        if self.mods is not None:
            return self._new_token_pieces(q, k_all, v_all, request, out, lse)
        for chunk in request.local_chunks:
            rows = slice(chunk.row, chunk.row + chunk.length)
            if self.causal_offsets:
                keys = _new_keys(request, 0, chunk.new_start + chunk.length)
                out[rows], lse[rows] = self.backend.attend(q[rows], _rows(k_all, keys), _rows(v_all, keys),
                                                           self.scale, True, causal_offset=chunk.new_start)
                continue
            own = _new_keys(request, chunk.new_start, chunk.new_start + chunk.length)
            out[rows], lse[rows] = self.backend.attend(q[rows], _rows(k_all, own), _rows(v_all, own), self.scale,
                                                       causal=True)
            if chunk.new_start > 0:
                before = _new_keys(request, 0, chunk.new_start)
                _accumulate(out, lse, rows, *self.backend.attend(q[rows], _rows(k_all, before), _rows(v_all, before),
                                                                 self.scale, False))

    def _new_token_pieces(self, q, k_all, v_all, request: RequestAttention, out, lse) -> None:
        """`_new_token_attention` with score modifiers: the keys before each run trimmed to the window (skipped
        where it leaves none), the run itself band-masked where it is longer than the window."""
        for chunk in request.local_chunks:
            # key runs in new-token index space (row = index into new_kv_rows): [0, s) before, [s, s+n) itself
            source = ((0, 0, chunk.new_start), (chunk.new_start, chunk.new_start, chunk.length))
            for piece in self.mods.new_key_pieces(source, chunk.new_start, chunk.length):
                keys, rows = request.new_kv_rows[piece.keys], piece.rows(chunk.row)
                _accumulate(out, lse, rows, *self.mods.attend(self.backend, self.scale, q[rows],
                                                              _rows(k_all, keys), _rows(v_all, keys), piece))

    def _ring_new_tokens(self, q, k, v, k_pool, v_pool, meta, out, lse) -> None:
        """Pass-KV ring: the block of PCP rank (me - i) arrives at step i while step i-1's attention runs."""
        pcp, n = self.pcp, meta.num_rows
        block = torch.stack(self.backend.rows_to_move(k, v))  # [parts, N, ...]: K and V, or one latent row
        for step in range(pcp.size):
            source = (pcp.rank - step) % pcp.size
            transfer = ring_exchange(block, pcp.group) if step < pcp.size - 1 else None
            mine = (meta.write_rows >= source * n) & (meta.write_rows < (source + 1) * n)
            rows = meta.write_rows[mine] - source * n
            k_block, v_block = self.backend.rows_moved(tuple(block))
            self.backend.store_kv(k_pool, v_pool, meta.write_slots[mine], k_block, v_block, rows)
            for request in meta.requests:
                if request.num_new > 1:
                    self._ring_pair(q, k_block, v_block, source, request, out, lse, first=step == 0)
            if transfer is not None:
                block = transfer.wait()

    def _ring_pair(self, q, k_block, v_block, source: int, request: RequestAttention, out, lse,
                   first: bool = False) -> None:
        """The calls of each local run against the block of PCP rank `source`; `first`: step 0, this rank's own
        block, whose first call for a run is the run's first partial (written, not merged: exactly the merge's
        result)."""
        if self.mods is not None:  # the window trims (or skips) each key run
            for chunk in request.local_chunks:
                for piece in self.mods.new_key_pieces(request.source_rank_rows[source], chunk.new_start,
                                                      chunk.length):
                    rows = piece.rows(chunk.row)
                    _accumulate(out, lse, rows, *self.mods.attend(self.backend, self.scale, q[rows],
                                                                  k_block[piece.keys], v_block[piece.keys], piece))
            return
        for chunk in request.local_chunks:
            rows = slice(chunk.row, chunk.row + chunk.length)
            source_rows = request.source_rank_rows[source]
            calls = (joined_key_runs(source_rows, chunk.new_start) if self.causal_offsets
                     else [(keys, 0 if causal else None) for keys, causal in key_runs(source_rows, chunk.new_start)])
            for call, (keys, offset) in enumerate(calls):
                kwargs = {"causal_offset": offset} if offset else {}  # None: unmasked, 0: square causal
                part = self.backend.attend(q[rows], k_block[keys], v_block[keys], self.scale, offset is not None,
                                           **kwargs)
                if first and call == 0:  # the run's first partial: its rows still hold (0, -inf), nothing to merge
                    out[rows], lse[rows] = part
                else:
                    _accumulate(out, lse, rows, *part)

    def _decode_context(self, q_all, k_pool, v_pool, meta: AttentionMetadata, o_part, lse_part,
                        num_pieces: int) -> None:
        """All single-token queries of every piece against this rank's shard, one padded call per piece."""
        decode, n = meta.decode, meta.num_rows
        if decode.max_local_context == 0:
            return  # this rank's shard is empty for every one of them: their partials stay (0, -inf)
        by_dcp_rank = {}
        for piece in range(num_pieces):
            rows = decode.rows[self.piece_pcp_rank[piece]] + piece * n  # [B]
            dcp_rank = self.piece_dcp_rank[piece]
            if dcp_rank not in by_dcp_rank:
                # Every PCP rank holds the same single-token queries: attend once per DCP rank, copy for the rest.
                by_dcp_rank[dcp_rank] = self.backend.attend_decode(q_all[rows], k_pool, v_pool, decode,
                                                                   self.scale, **self._decode_kwargs)
            o_piece, lse_piece = by_dcp_rank[dcp_rank]
            o_part[rows], lse_part[rows] = o_piece.to(o_part.dtype), lse_piece  # index_put wants equal dtypes

    def context_partial(self, q, k_pool, v_pool, meta: AttentionMetadata):
        """The cached-context piece of `forward`'s general path alone -> (out, lse) float32: every row's queries
        gathered over the KV-shard group, attended to each shard, merged back exactly. With `new_token_partial`,
        the two pieces a kind assembles itself when its new tokens attend in another form than its cache (MLA's
        expanded prefill on one PCP rank); the caller stores the new rows first and merges the two."""
        return self._context(q, k_pool, v_pool, meta)

    def new_token_partial(self, q, k_new, v_new, meta: AttentionMetadata):
        """The new-token piece of `forward`'s general path on one PCP rank alone -> (out, lse) float32: each
        request's local runs against its new keys (the rows of `k_new`/`v_new` in `request.new_kv_rows`), causal
        by position. Keys and values may be in any form the backend attends (values narrower than the keys)."""
        out = torch.zeros((*q.shape[:2], v_new.shape[-1]), dtype=accumulator_dtype(q.dtype), device=q.device)
        lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
        for request in meta.requests:
            if request.num_new > 1:
                self._new_token_attention(q, k_new, v_new, request, out, lse)
        return out, lse

    def _context(self, q, k_pool, v_pool, meta: AttentionMetadata):
        """Queries of the whole KV shard group against this rank's shard, merged back on their owners."""
        n, pieces = meta.num_rows, self.kv.size
        # [pieces * N, Hq, D]: piece c from group rank c (no call at all when this rank holds the whole context)
        q_all = all_gather(q, self.kv.group) if pieces > 1 else q
        o_part = torch.zeros(q_all.shape, dtype=accumulator_dtype(q.dtype), device=q.device)
        lse_part = torch.full(q_all.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
        if meta.decode is not None:
            self._decode_context(q_all, k_pool, v_pool, meta, o_part, lse_part, pieces)
        batched = set(meta.decode.requests) if meta.decode is not None else set()
        for index, request in enumerate(meta.requests):
            if index in batched or request.context_len == 0 or request.context_slots.numel() == 0:
                continue
            if self.parallel.dims.kv_replicated and not request.local_chunks:
                continue  # every piece holds this PCP rank's rows, and it holds none of this request
            if self.mods is not None:
                self._context_pieces(q_all, k_pool, v_pool, request, meta, o_part, lse_part)
                continue
            k_ctx, v_ctx = self.backend.context_keys(k_pool, v_pool, request.context_slots, q.dtype)
            for piece in range(pieces):
                start, end = request.pcp_rows[self.piece_pcp_rank[piece]]
                if end > start:
                    rows = slice(piece * n + start, piece * n + end)
                    o_part[rows], lse_part[rows] = self.backend.attend(q_all[rows], k_ctx, v_ctx, self.scale,
                                                                       causal=False)
        if pieces == 1:
            return o_part, lse_part
        # Send piece c's partial back to group rank c; receive every rank's partial of this rank's queries.
        # Output and lse travel together in one float32 message: [pieces * N, Hq, D + 1].
        packed = all_to_all(torch.cat((o_part.float(), lse_part.unsqueeze(-1)), dim=-1), self.kv.group)
        packed = packed.view(pieces, n, q.shape[1], q.shape[2] + 1)
        return merge_attention_partials(packed[..., :-1], packed[..., -1])  # float32

    def _context_pieces(self, q_all, k_pool, v_pool, request: RequestAttention, meta: AttentionMetadata, o_part,
                        lse_part) -> None:
        """One request's cached context with score modifiers: only the shard's keys in the window of its first
        query are read, and each query run of each piece attends the suffix its own window leaves (no call where it
        leaves none)."""
        layout, mods, n = meta.kv_layout, self.mods, meta.num_rows
        lo, hi = mods.context_range(layout, request.context_len, request.start_pos)
        if lo >= hi:
            return  # the whole shard lies before every query's window
        k_ctx, v_ctx = self.backend.context_keys(k_pool, v_pool, request.context_slots[lo:hi], q_all.dtype)
        for piece_index in range(self.kv.size):
            for row, new_start, length in request.source_rank_rows[self.piece_pcp_rank[piece_index]]:
                piece = mods.context_piece(layout, request.context_len, lo, request.start_pos + new_start, length)
                if piece is None:
                    continue
                rows = piece.rows(piece_index * n + row)
                o_part[rows], lse_part[rows] = mods.attend(self.backend, self.scale, q_all[rows], k_ctx[piece.keys],
                                                           v_ctx[piece.keys], piece)

    def _replicated_query_context(self, q, k_pool, v_pool, meta: AttentionMetadata):
        """A step of single tokens without DCP, sharded layout: every CP rank already holds every query, at the same
        rows, so each attends them to its own shard and the partials are all-gathered and merged (one collective,
        not two)."""
        decode = meta.decode
        rows = decode.rows[self.pcp.rank]  # [B]
        if decode.max_local_context > 0 and rows.numel() == meta.num_rows:  # rows 0..N-1: every row a query
            o_part, lse_part = self.backend.attend_decode(q, k_pool, v_pool, decode, self.scale,
                                                          **self._decode_kwargs)
        else:
            o_part = torch.zeros(q.shape, dtype=accumulator_dtype(q.dtype), device=q.device)
            lse_part = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
            self._decode_context(q, k_pool, v_pool, meta, o_part, lse_part, num_pieces=1)
        packed = all_gather(torch.cat((o_part.float(), lse_part.unsqueeze(-1)), dim=-1), self.cp.group)
        packed = packed.view(self.cp.size, *q.shape[:2], q.shape[2] + 1)  # [C, N, Hq, D + 1]
        return merge_attention_partials(packed[..., :-1], packed[..., -1])  # float32


def _new_keys(request: RequestAttention, start: int, end: int) -> slice | torch.Tensor:
    """Rows of the gathered new K/V for the request's new tokens [start, end): a slice where they are one run
    (read in place, no copy), else their indices."""
    if request.new_kv_first is not None:
        return slice(request.new_kv_first + start, request.new_kv_first + end)
    return request.new_kv_rows[start:end]


def _rows(kv: torch.Tensor, keys: slice | torch.Tensor) -> torch.Tensor:
    """`kv[keys]`: a view for a slice, one index_select for indices (advanced indexing runs 2-3x slower on the CPU)."""
    return kv[keys] if isinstance(keys, slice) else kv.index_select(0, keys)


def _unset_partials(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised (out, lse) for every row of q, for calls that write each row once."""
    return (torch.empty(q.shape, dtype=accumulator_dtype(q.dtype), device=q.device),
            torch.empty(q.shape[:2], dtype=torch.float32, device=q.device))


def _empty_partials(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(0, -inf) for every row of q: the partials of no key, which every merge leaves as the other side."""
    return (torch.zeros(q.shape, dtype=accumulator_dtype(q.dtype), device=q.device),
            torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device))


@dataclasses.dataclass(kw_only=True, frozen=True, slots=True)
class OneCall:
    """A step whose rows one backend call attends (PagedCPAttention._one_call)."""

    request: RequestAttention
    """The one request with a run of new tokens."""
    end: int
    """Its first `end` new keys, in position order, are the call's keys."""
    offset: int | torch.Tensor
    """The causal offset: one int, or an int32 tensor with one per row."""
    covered: int
    """The rows of its runs, from row 0; the rest take (0, -inf)."""


def _runs_of_all_rows(meta: AttentionMetadata, rows: int):
    """(request, its local runs, the rows they cover) where a step's local runs of new tokens are one request's and
    lead its `rows` rows in order (one run, or a PCP rank's head and tail chunks of one prompt, then any padding
    rows of a rank holding fewer tokens), else None."""
    requests = [request for request in meta.requests if request.num_new > 1]
    if len(requests) != 1:
        return None
    chunks, row = requests[0].local_chunks, 0
    for chunk in chunks:
        if chunk.row != row:
            return None
        row += chunk.length
    return (requests[0], chunks, row) if 0 < row <= rows else None
