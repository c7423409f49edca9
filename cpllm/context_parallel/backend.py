"""The interface between the context-parallel attention layer and one layer kind's local work.

PagedCPAttention (attention.py) and pass-Q (pass_q.py) own everything that crosses ranks: all-gather, the pass-KV
ring, pass-Q, the DCP query gather and the all-to-all of partials, the log-sum-exp merges, the replicated layout's
copies. On its own rank each asks a backend for local work only: which tensors hold a step's new rows (what PCP
moves), store them in the paged pools, attend a set of query rows to a set of keys, and attend single-token
(decode) rows to their context read from the pools. Every answer is a partial (out, lse) the layer merges exactly
in float32, so the layer is written once for every kind. Windows, soft-capping and sinks are score modifiers the
layer applies to pieces (cpllm/layers/window/modifier.py), not backend methods.

A backend holds no per-layer state; which kernel runs inside it (a C kernel, SDPA, the CUDA kernels) is its own
choice, made per call from the tensors it is given. The step's metadata is laid out the same whatever kernels
exist (decode rows carry each request's own slots); an implementation wanting another form of it (the shared-key
union) builds that as a per-step cached view of the batch (kept in its `StepViews`). Backends live in their kind's
package under cpllm/layers/ and are registered there (cpllm/layers/registry.py).
"""

from __future__ import annotations

from typing import Protocol

import torch

class AttentionBackend(Protocol):
    """One rank's attention over its paged K/V pools (shapes: q [N, Hq, D], k/v [S, Hkv, D], pools [num_slots,
    Hkv, D]; `decode` is the step's `DecodeBatch`)."""

    name: str
    """The registry key (`BACKENDS`)."""

    def store_kv(self, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, rows: torch.Tensor) -> None:
        """pools[slots[i]] = (k, v)[rows[i]], in the pools' dtype."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Query rows against a key set (causal: square, query i sees keys 0..i) -> out [N, Hq, D] (q's dtype or
        wider), lse [N, Hq] float32; a row that sees no key gets (0, -inf). A backend with `causal_offsets = True`
        (a class attribute; absent means False) also takes `causal_offset=c`: query i sees keys 0..i + c, so the
        layer attends a query run and the keys just before it in one call instead of two merged."""

    def rows_to_move(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """What PCP moves of a step's new rows (all-gather, the pass-KV ring, pass-Q's returned rows): the tensors
        [N, ...] that hold this kind's new cache rows (K and V; one latent row that is both)."""

    def rows_moved(self, parts: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) back from the moved tensors (`rows_to_move`'s, gathered or received)."""

    def context_keys(self, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor,
                     dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values at `slots` [S], in `dtype`, for `attend` (one request's cached context, attended by
        several query runs): tensors [S, Hkv, D], or views of the pools that `attend` reads in place, which slice
        like tensors and read out with `.tensor()`."""

    def attend_decode(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, decode,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode rows [B, Hq, D] against this rank's share of their context, read from the pools in place ->
        out [B, Hq, D], lse [B, Hq] float32; a request with no local context gets (0, -inf). A soft-capped layer
        passes `score_mod=` (keyword: an elementwise function of the scaled scores, its modifier's); a windowed one passes the batch's in-window view
        (cpllm/layers/window/decode_view.py), which needs no mask."""

    def attend_decode_whole(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, decode,
                            scale: float) -> torch.Tensor:
        """As `attend_decode` where each row's whole context (itself included) is in these pools, so every row
        sees a key and no partial is merged: out [B, Hq, D] only (the one-shard and compiled decode paths)."""

    def decode_context(self, pool: torch.Tensor, decode, dtype: torch.dtype) -> torch.Tensor:
        """The decode rows' context gathered once, for several query blocks to attend (pass-Q): opaque to the
        layer, read back only by `attend_gathered_decode`."""

    def attend_gathered_decode(self, q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, decode,
                               scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """`attend_decode` over contexts from `decode_context` (`score_mod=` as there)."""

    def decode_form(self, decode, k_pool: torch.Tensor):
        """The form of `decode` (each request's own slots, as every step lays it out) that this backend's
        implementation reads from these pools: `decode` itself or a view of it built once per step (the GQA
        backend's SDPA path: the union of shared keys). Asked once per step by the compiled decode step, whose
        graphs cannot build a view; the eager calls above choose for themselves."""
