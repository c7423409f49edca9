"""The sparse-MLA backend: MLA's latent pool (as cpllm/layers/mla/ lays it out) plus the index pool, and
the absorbed attention of queries over only their selected latent rows, read in place from the paged pool.

The cache of a layer is (latent pool [slots, 1, r + rope], index pool [slots, 1, index_head_dim]); the latent
pool's protocol methods are MLA's backend's, inherited. Attention is the absorbed MLA form (the layer folds W_UK
into the queries and applies W_UV after), in float32:
- `attend_selected`: each row's own selected slots [L, K] (K <= index_topk rows, never the whole context): decode
  steps. The C decode kernel MLA's dense decode runs (cpllm/kernels/decode_attention.c) reads those rows in place
  from the pool, through a slot table of each row's selected slots; where it does not apply, the selected rows
  (only they) are gathered and attended in torch;
- `attend_masked`: rows against one key set [T] with a [L, T] mask of what each row selected: a prompt chunk's
  rows, which share their keys.
"""

from __future__ import annotations

import torch

from cpllm.kernels import decode_attention
from cpllm.layers.mla.backend import MLAPagedBackend


def _absorbed(q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, scale: float, width: int):
    # q [L, H, W], keys [L, K, W] (each row its own) or [K, W] (shared), visible [L, K] bool
    # -> (out [L, H, width] float32, lse [L, H] float32); a row that sees no key gets (0, -inf)
    q, keys = q.float(), keys.float()
    shared = keys.dim() == 2
    scores = torch.einsum("lhw,kw->lhk" if shared else "lhw,lkw->lhk", q, keys) * scale
    scores = scores.masked_fill(~visible.unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [L, H]
    probs = torch.exp(scores - torch.where(torch.isneginf(lse), 0.0, lse).unsqueeze(-1))  # 0 where unseen
    out = torch.einsum("lhk,kr->lhr" if shared else "lhk,lkr->lhr", probs, keys[..., :width])
    return out, lse


def _selected_in_place(q, latent_pool, slots, visible, scale: float, width: int):
    # The C decode kernel (cpllm/kernels/decode_attention.c, MLA's dense decode) over each row's visible selected
    # slots, moved to the front of its slot list: the pool read in place, one KV head whose keys and values are
    # the latent rows; None where the kernel does not apply (the caller gathers the rows)
    if not decode_attention.applies(q, latent_pool) or not latent_pool.is_contiguous():
        return None
    order = torch.argsort((~visible).to(torch.uint8), dim=-1, stable=True)  # visible first, in selection order
    table = slots.gather(-1, order).contiguous()
    lengths = visible.sum(dim=-1)
    out, lse = decode_attention.paged_decode_attention(q.float(), latent_pool, latent_pool, table, lengths, scale)
    return out[..., :width], lse


class SparseMLABackend(MLAPagedBackend):
    """MLA's latent pool and the index pool beside it (see the module). The protocol's methods
    (`AttentionBackend`, cpllm/context_parallel/backend.py) are MLA's (cpllm/layers/mla/backend.py): the latent pool
    read as keys and values, each row stored and moved once; this kind adds the index pool and the attention over
    selected rows."""

    name = "sparse_mla"

    @staticmethod
    def store_index(index_pool: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor, rows: torch.Tensor) -> None:
        """index_pool[slots[i]] = keys[rows[i]] (keys [N, 1, D])."""
        index_pool.index_copy_(0, slots, keys.index_select(0, rows).to(index_pool.dtype))

    @staticmethod
    def attend_selected(q: torch.Tensor, latent_pool: torch.Tensor, slots: torch.Tensor, visible: torch.Tensor,
                        scale: float, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """q [L, H, W] against each row's own selected slots [L, K] (visible [L, K]: which are real) read from the
        pool -> (out [L, H, width], lse [L, H]) float32: the value columns and the partial's log-sum-exp."""
        in_place = _selected_in_place(q, latent_pool, slots, visible, scale, width)
        if in_place is not None:
            return in_place
        rows = latent_pool[slots.reshape(-1), 0].view(*slots.shape, latent_pool.shape[-1])  # [L, K, W]
        return _absorbed(q, rows, visible, scale, width)

    @staticmethod
    def attend_masked(q: torch.Tensor, latent_pool: torch.Tensor, slots: torch.Tensor, visible: torch.Tensor,
                      scale: float, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """q [L, H, W] against the keys at `slots` [T], row l seeing those where visible[l] -> (out, lse) as
        `attend_selected`."""
        return _absorbed(q, latent_pool.index_select(0, slots)[:, 0], visible, scale, width)
