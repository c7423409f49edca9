"""The top-k of the indexer's scores, with one tie rule wherever it is taken (torch only, no layer state).

Tie rule: a higher score first; between equal scores, the lower position first. Keys may come in any order
(a rank's own positions, or candidates gathered from several ranks): the rule reads positions, not columns, so
the top-k of a union of candidate lists, each already cut to its own top-k by the same rule, equals the top-k of
the whole set (a key beaten by k others in its own list is beaten by the same k in the union).

`top_k` runs the C kernel (cpllm/kernels/index_topk.c, the same selection bit for bit, ties and -inf included)
where it applies and this torch form (`torch_top_k`) where it does not (kernels off or not built, another
device)."""

from __future__ import annotations

import torch

from cpllm.kernels.index_topk import index_top_k


def top_k(scores: torch.Tensor, positions: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [L, T] float32 (-inf: a key the row may not see), positions [T] or [L, T] long -> the best
    min(k, T) of each row by the tie rule: (scores [L, k'], positions [L, k']), best first; an entry whose score
    is -inf selects nothing (the row saw fewer than k' keys)."""
    if k < 1:
        raise ValueError(f"top-k of k={k}: k must be >= 1")
    rows, width = scores.shape
    if positions.dim() == 1:
        positions = positions.unsqueeze(0).expand(rows, width)
    if positions.shape != scores.shape:
        raise ValueError(f"top-k: positions {tuple(positions.shape)} do not match scores {tuple(scores.shape)}")
    chosen = index_top_k(scores, positions, k)
    return torch_top_k(scores, positions, k) if chosen is None else chosen


def torch_top_k(scores: torch.Tensor, positions: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`top_k` in torch (its fallback, and the kernel's reference): scores and positions [L, T], k >= 1."""
    width = scores.shape[1]
    # order by position first, then a stable sort by score keeps that order among equal scores
    by_position = positions.argsort(dim=-1, stable=True)  # [L, T]
    pos = positions.gather(-1, by_position)
    ranked = scores.gather(-1, by_position)
    order = ranked.sort(dim=-1, descending=True, stable=True).indices[:, :min(k, width)]  # [L, k']
    return ranked.gather(-1, order), pos.gather(-1, order)


def selected_mask(local_index: torch.Tensor, chosen: torch.Tensor, num_keys: int) -> torch.Tensor:
    """[L, k'] local indices of selected keys, chosen [L, k'] (False: no key there, or another rank's) ->
    [L, num_keys] bool, True at the selected keys of this rank."""
    mask = torch.zeros(local_index.shape[0], num_keys + 1, dtype=torch.bool, device=local_index.device)
    target = torch.where(chosen, local_index, torch.full_like(local_index, num_keys))
    mask.scatter_(1, target, True)
    return mask[:, :num_keys]
