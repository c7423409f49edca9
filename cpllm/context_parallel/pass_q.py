"""Pass-Q: the queries travel around the CP ring, the K/V stay where they are.

The pass-KV ring (`ring` strategy) moves every new token's K/V to every PCP
rank. When a short chunk meets a long cached context (multi-turn, prefix hits),
the keys a query needs are mostly cached and already sharded over the CP group,
so moving the few queries is cheaper (Yang et al., arXiv 2411.01783, section 3).

Per layer, on CP rank `r = (p, d)` (`p` its PCP rank, `d` its DCP rank):
1. Store the new tokens it computed and owns (single tokens included, so they
   are in the pool before they attend to their own context).
2. For `C = cp_size` ring steps, hold the query block of CP rank
   `s = r - step` (step 0: its own) while the next block is in flight, and
   attend it to the keys it holds (a step without cached context rings over
   the PCP group only: the other DCP ranks would have nothing to attend):
   - its shard of every request's cached context (positions it owns `< P`);
   - the new tokens it computed, only when `s` has the same DCP rank `d`: the
     DCP ranks of one PCP rank hold the same new tokens (same KV heads), so
     exactly one of them answers for them. A query run and a key run are
     head-tail chunks of one request: the same chunk (square causal), keys
     wholly before the queries (no mask) or wholly after (skipped).
   The partial (out, lse) of block `s` accumulates in float32 in slot `s`.
3. One all-to-all returns slot `s` to rank `s`, carrying as well the new K/V
   rows each owner must store (`pass_q_plan.py`); every rank merges the `C`
   partials of its own queries exactly (merge.py) and stores the rows it got.

Single-token (decode) rows of a mixed step attend only to the cached context,
themselves included, like in the other strategies: every PCP rank holds them,
so their partial is computed once per DCP rank and copied for the others.
"""

from __future__ import annotations

import torch

from cpllm.context_parallel.merge import accumulate, accumulator_dtype, merge_attention_partials
from cpllm.context_parallel.metadata import AttentionMetadata, RequestAttention
from cpllm.context_parallel.partition import key_runs
from cpllm.distributed.comm import all_to_all, ring_exchange


def pass_q_attention(parallel, backend, scale: float, q, k, v, k_pool, v_pool, meta: AttentionMetadata, mods=None):
    """Attention of this rank's query rows over new tokens and cached context; (out, lse) in float32. `backend`
    (an `AttentionBackend`) stores and attends on this rank; `parallel` is the layer's `ParallelContext`. `mods` (a window, a soft-cap) apply to every piece
    on its own keys (cpllm/layers/window/modifier.py); the layer passes decode rows' in-window view in
    `meta.decode`.

    q [N, Hq, D]; k, v [N, Hkv, D]; k_pool, v_pool [num_slots, Hkv, D]; `meta.pass_q` is set."""
    plan = meta.pass_q
    ring = _Ring(parallel, meta.has_context)
    backend.store_kv(k_pool, v_pool, plan.local_slots, k, v, plan.local_rows)
    piece = _PieceAttention(parallel, backend, scale, k, v, k_pool, v_pool, meta, mods)
    o_part = torch.zeros((ring.size, *q.shape), dtype=accumulator_dtype(q.dtype), device=q.device)  # [R, N, Hq, D]
    lse_part = torch.full((ring.size, *q.shape[:2]), float("-inf"), dtype=torch.float32, device=q.device)
    block = q
    for step in range(ring.size):
        source = (ring.rank - step) % ring.size
        transfer = ring_exchange(block, ring.group) if step < ring.size - 1 else None
        piece(block, *ring.coords(source), o_part[source], lse_part[source])
        if transfer is not None:
            block = transfer.wait()
    return _return_partials(ring, backend, o_part, lse_part, k, v, k_pool, v_pool, plan)


class _Ring:
    """The ranks the queries visit: the CP group when some request reads cached context (it is sharded over
    all PCP x DCP ranks), else only the PCP group (the DCP ranks of a PCP rank hold the same new tokens)."""

    def __init__(self, parallel, has_context: bool):
        self.whole_cp = has_context or parallel.dims.dcp == 1
        kind = "cp" if self.whole_cp else "pcp"
        ring = parallel.comm(kind)
        self.group, self.size, self.rank = ring.group, ring.size, ring.rank
        self._coords = tuple(parallel.member_coords(kind, index) for index in range(ring.size))
        self._cp_ranks = parallel.member_cp_ranks(kind)

    def coords(self, index: int) -> tuple[int, int]:
        """(PCP rank, DCP rank) of the ring member at group rank `index`."""
        return self._coords[index]

    def members(self, per_cp_rank: tuple[int, ...]) -> list[int]:
        """A per-CP-rank list restricted to the ring's members, in group-rank order."""
        return [per_cp_rank[cp_rank] for cp_rank in self._cp_ranks]


class _PieceAttention:
    """Attends one visiting query block (the rows of PCP rank `src_pcp`, heads of DCP rank `src_dcp`) to the
    keys this rank holds; the cached context is read from the pools once per layer, not once per block."""

    def __init__(self, parallel, backend, scale, k, v, k_pool, v_pool, meta: AttentionMetadata, mods=None):
        self.backend, self.scale, self.k, self.v, self.meta, self.mods = backend, scale, k, v, meta, mods
        self.my_pcp, self.my_dcp = parallel.rank("pcp"), parallel.rank("dcp")
        batched = set(meta.decode.requests) if meta.decode is not None else set()
        readers = [request for index, request in enumerate(meta.requests)
                   if index not in batched and request.context_len > 0 and request.context_slots.numel() > 0]
        if mods is None:
            self.contexts = [(request, *backend.context_keys(k_pool, v_pool, request.context_slots, k.dtype))
                             for request in readers]
        else:  # only the shard's keys in the window of the request's first query are read
            self.windowed = []
            for request in readers:
                lo, hi = mods.context_range(meta.kv_layout, request.context_len, request.start_pos)
                if lo < hi:
                    self.windowed.append((request, lo, *backend.context_keys(
                        k_pool, v_pool, request.context_slots[lo:hi], k.dtype)))
            self.contexts = []
        self._decode_kwargs = {} if mods is None else mods.decode_kwargs
        self.decode_ctx = None
        if meta.decode is not None and meta.decode.max_local_context > 0:
            self.decode_ctx = (backend.decode_context(k_pool, meta.decode, k.dtype),
                               backend.decode_context(v_pool, meta.decode, v.dtype))
        self._decode_by_dcp: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, q_block, src_pcp: int, src_dcp: int, out, lse) -> None:
        # q_block [N, Hq, D]; out [N, Hq, D] and lse [N, Hq] are this block's float32 accumulators
        if self.mods is not None:
            self._windowed_contexts(q_block, src_pcp, out, lse)
        for request, k_ctx, v_ctx in self.contexts:
            start, end = request.pcp_rows[src_pcp]
            if end > start:
                accumulate(out, lse, slice(start, end),
                           *self.backend.attend(q_block[start:end], k_ctx, v_ctx, self.scale, False))
        if src_dcp == self.my_dcp:
            for request in self.meta.requests:
                if request.num_new > 1:
                    self._new_tokens(q_block, src_pcp, request, out, lse)
        if self.decode_ctx is not None:
            self._single_tokens(q_block, src_pcp, src_dcp, out, lse)

    def _windowed_contexts(self, q_block, src_pcp: int, out, lse) -> None:
        """The cached contexts with score modifiers: each query run of the block against the suffix of the shard
        its window leaves (no call where it leaves none)."""
        layout = self.meta.kv_layout
        for request, lo, k_ctx, v_ctx in self.windowed:
            for row, new_start, length in request.source_rank_rows[src_pcp]:
                piece = self.mods.context_piece(layout, request.context_len, lo, request.start_pos + new_start,
                                                length)
                if piece is not None:
                    rows = piece.rows(row)
                    accumulate(out, lse, rows, *self.mods.attend(self.backend, self.scale, q_block[rows],
                                                                 k_ctx[piece.keys], v_ctx[piece.keys], piece))

    def _new_tokens(self, q_block, src_pcp: int, request: RequestAttention, out, lse) -> None:
        if self.mods is not None:
            for q_row, q_start, q_len in request.source_rank_rows[src_pcp]:
                for piece in self.mods.new_key_pieces(request.source_rank_rows[self.my_pcp], q_start, q_len):
                    rows = piece.rows(q_row)
                    accumulate(out, lse, rows, *self.mods.attend(self.backend, self.scale, q_block[rows],
                                                                 self.k[piece.keys], self.v[piece.keys], piece))
            return
        for q_row, q_start, q_len in request.source_rank_rows[src_pcp]:
            rows = slice(q_row, q_row + q_len)
            for keys, causal in key_runs(request.source_rank_rows[self.my_pcp], q_start):
                accumulate(out, lse, rows,
                           *self.backend.attend(q_block[rows], self.k[keys], self.v[keys], self.scale, causal))

    def _single_tokens(self, q_block, src_pcp: int, src_dcp: int, out, lse) -> None:
        decode = self.meta.decode
        rows = decode.rows[src_pcp]  # [B]
        if src_dcp not in self._decode_by_dcp:  # the same queries on every PCP rank: attend once per DCP rank
            self._decode_by_dcp[src_dcp] = self.backend.attend_gathered_decode(q_block[rows], *self.decode_ctx,
                                                                               decode, self.scale,
                                                                               **self._decode_kwargs)
        o_piece, lse_piece = self._decode_by_dcp[src_dcp]
        out[rows], lse[rows] = o_piece.to(out.dtype), lse_piece  # the only partial of these rows so far


def _return_partials(ring: _Ring, backend, o_part, lse_part, k, v, k_pool, v_pool, plan):
    """One all-to-all: slot s of the partials (and the new K/V rows ring member s owns) go to member s."""
    size_r, n, heads, dim = o_part.shape
    parts = len(backend.rows_to_move(k, v))  # K and V, or one latent row that is both (views: no copy)
    kv_width = parts * k.shape[1] * k.shape[2]
    partial = torch.cat((o_part.float(), lse_part.unsqueeze(-1)), dim=-1).view(size_r, -1)  # [R, N * Hq * (D+1)]
    send_counts, recv_counts = ring.members(plan.send_counts), ring.members(plan.recv_counts)
    rows = plan.send_rows.split(send_counts)  # K/V go only to ring members (same DCP rank), in group order
    pieces = []
    for dest in range(size_r):
        pieces.append(partial[dest])
        if send_counts[dest]:
            moved = backend.rows_to_move(k[rows[dest]], v[rows[dest]])
            pieces.append(torch.stack(moved, dim=1).float().reshape(-1))  # [m, parts, Hkv, D]
    size = partial.shape[1]
    received = all_to_all(torch.cat(pieces), ring.group,
                          input_split_sizes=[size + c * kv_width for c in send_counts],
                          output_split_sizes=[size + c * kv_width for c in recv_counts])
    partials, kv_rows = [], []
    for part in received.split([size + c * kv_width for c in recv_counts]):
        partials.append(part[:size])
        kv_rows.append(part[size:])
    if plan.recv_slots.numel():
        kv = torch.cat(kv_rows).view(-1, parts, *k.shape[1:])  # [n_recv, parts, Hkv, D]
        every = torch.arange(kv.shape[0], device=kv.device)
        backend.store_kv(k_pool, v_pool, plan.recv_slots, *backend.rows_moved(kv.unbind(1)), every)
    packed = torch.stack(partials).view(size_r, n, heads, dim + 1)
    return merge_attention_partials(packed[..., :-1], packed[..., -1])  # float32
