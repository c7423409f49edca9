"""The interface between the context-parallel attention layer and one local attention kind, and their registry.

PagedCPAttention (attention.py) and pass-Q (pass_q.py) own everything that crosses ranks: all-gather, the pass-KV
ring, pass-Q, the DCP query gather and the all-to-all of partials, the log-sum-exp merges, the replicated layout's
copies. On its own rank each asks a backend for three things only: store new K/V in the paged pools, attend a set
of query rows to a set of keys (with a window's mask or a soft-cap: `attend_scored`), and attend single-token
(decode) rows to their context read from the pools. Every
answer is a partial (out, lse) the layer merges exactly in float32, so the layer is written once for every kind.

A backend holds no per-layer state; which kernel runs inside it (a C kernel, SDPA, the CUDA kernels) is its own
choice, made per call from the tensors it is given. The step's metadata is laid out the same whatever kernels
exist (decode rows carry each request's own slots); an implementation wanting another form of it (the shared-key
union) builds that as a per-step cached view (metadata.py `shared_key_view`). A new kind (a latent-KV pool, a windowed one) is a new module
with a class that satisfies `AttentionBackend`, and one line in `BACKENDS`.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from cpllm.context_parallel.gqa_backend import GQAPagedBackend
from cpllm.context_parallel.mla_backend import MLAPagedBackend
from cpllm.context_parallel.triton_backend import TritonPagedBackend


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
        wider), lse [N, Hq] float32; a row that sees no key gets (0, -inf)."""

    def attend_scored(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *,
                      causal: bool = False, mask: torch.Tensor | None = None,
                      softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`attend` with score modifiers the fast kernels do not know: a bool keep-mask [N, S] (a sliding window's
        band, from positions; True keeps) and/or logit soft-capping (softcap * tanh(score / softcap) before the
        mask). Called only by layers that have a window or a soft-cap (window.py)."""

    def context_keys(self, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor,
                     dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values at `slots` [S] read out of the pools, in `dtype`, for `attend` (one request's
        cached context, attended by several query runs)."""

    def attend_decode(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, decode,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode rows [B, Hq, D] against this rank's share of their context, read from the pools in place ->
        out [B, Hq, D], lse [B, Hq] float32; a request with no local context gets (0, -inf). A soft-capped layer
        passes `softcap=` (keyword); a windowed one passes the batch's in-window view (metadata.py
        `window_view`), which needs no mask."""

    def attend_decode_whole(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, decode,
                            scale: float) -> torch.Tensor:
        """As `attend_decode` where each row's whole context (itself included) is in these pools, so every row
        sees a key and no partial is merged: out [B, Hq, D] only (the one-shard and compiled decode paths)."""

    def decode_context(self, pool: torch.Tensor, decode, dtype: torch.dtype) -> torch.Tensor:
        """The decode rows' context gathered once, for several query blocks to attend (pass-Q): opaque to the
        layer, read back only by `attend_gathered_decode`."""

    def attend_gathered_decode(self, q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, decode,
                               scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """`attend_decode` over contexts from `decode_context` (`softcap=` as there)."""

    def decode_form(self, decode, k_pool: torch.Tensor):
        """The form of `decode` (each request's own slots, as every step lays it out) that this backend's
        implementation reads from these pools: `decode` itself or a view of it built once per step (the GQA
        backend's SDPA path: the union of shared keys). Asked once per step by the compiled decode step, whose
        graphs cannot build a view; the eager calls above choose for themselves."""


BACKENDS: dict[str, Callable[[], AttentionBackend]] = {
    "gqa": GQAPagedBackend,
    "gqa-triton": TritonPagedBackend,  # the same kind, Triton kernels: chosen on CUDA (triton_backend.kind_for)
    "mla": MLAPagedBackend,  # one latent pool per layer, read as K and V (mla_backend.py)
}
"""Attention kinds by name: a factory each."""


def attention_backend(name: str = "gqa") -> AttentionBackend:
    """The backend registered as `name`."""
    try:
        return BACKENDS[name]()
    except KeyError:
        raise ValueError(f"no attention backend {name!r} (known: {', '.join(sorted(BACKENDS))})") from None
