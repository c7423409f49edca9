"""Exact combination of attention partials computed over disjoint key sets.

If partial `r` attended to key set `K_r` and returned its normalised output
`o_r` and log-sum-exp `lse_r`, attention over the union of the `K_r` is

    lse = log sum_r exp(lse_r)
    o   = sum_r exp(lse_r - lse) * o_r

(docs/context_parallel.md, "Exact merge"). Evaluated max-shifted in float32 so nothing overflows. An
empty key set has `lse_r = -inf` and contributes nothing, whatever its `o_r`
holds; a row where every partial is empty yields `o = 0`, `lse = -inf`.

The result has the partials' dtype: callers that accumulate over several merges
(PagedCPAttention) pass float32 accumulators, so a bf16/fp16 model rounds to its
own dtype only once, at the end; `merge_two` returns the wider of its inputs' dtypes. `accumulate` merges one
partial into such an accumulator in place.
"""

from __future__ import annotations

import torch


def merge_attention_partials(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge `S` partials stacked on dim 0.

    outs: [S, ..., H, D] partial outputs (any float dtype).
    lses: [S, ..., H] their log-sum-exps (natural log), -inf for an empty key set.
    Returns (out [..., H, D] in outs' dtype, lse [..., H] float32).
    """
    if outs.shape[:-1] != lses.shape:
        raise ValueError(
            f"outs shape {tuple(outs.shape)} does not match lses shape {tuple(lses.shape)} + [D]"
        )
    if outs.shape[0] == 0:
        raise ValueError("need at least one partial to merge, got S=0")
    lses = lses.float()
    max_lse = lses.amax(dim=0)  # [..., H]
    # Rows empty in every partial: shift by 0 instead of -inf to avoid inf - inf.
    shift = torch.where(torch.isneginf(max_lse), torch.zeros_like(max_lse), max_lse)
    weights = torch.exp(lses - shift)  # [S, ..., H], exactly 0 for empty partials
    total = weights.sum(dim=0)  # [..., H]
    lse = shift + torch.log(total)  # -inf where total == 0
    safe_total = torch.where(total > 0, total, torch.ones_like(total))
    scale = (weights / safe_total).unsqueeze(-1)  # [S, ..., H, 1]
    # An empty partial's output may be garbage (even NaN): zero it explicitly, 0 * NaN is NaN.
    zero = torch.zeros((), dtype=torch.float32, device=outs.device)
    contrib = torch.where(scale > 0, scale * outs.float(), zero)
    out = contrib.sum(dim=0)
    return out.to(outs.dtype), lse


def merge_two(
    o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partials: o [..., H, D], lse [..., H]. Output dtype: the wider of o1's and o2's
    (a float32 accumulator merged with a bf16 partial stays float32)."""
    dtype = torch.promote_types(o1.dtype, o2.dtype)
    out, lse = merge_attention_partials(
        torch.stack([o1.to(dtype), o2.to(dtype)]), torch.stack([lse1.float(), lse2.float()])
    )
    return out, lse


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """dtype partial outputs are merged in: float32 for bf16/fp16/fp32 models (float64 stays float64)."""
    return torch.promote_types(dtype, torch.float32)


def accumulate(out, lse, rows, o_part, lse_part) -> None:
    """Merge a partial into rows of a float32 accumulator, in place (docs/context_parallel.md, "Exact merge").

    The accumulator rows may be empty (out 0, lse -inf: their weight is exp(-inf) = 0). Prefill merges several
    partials per query run and layer, so this avoids merge_two's stacked copies: about four passes over the
    [rows, Hq, D] outputs instead of fifteen (PCP=2 prefill efficiency, docs/benchmarks.md (d)).
    """
    # out [N, Hq, D] float32, lse [N, Hq] float32; o_part [L, Hq, D], lse_part [L, Hq] for out[rows]
    held = lse[rows]
    new = torch.logaddexp(held, lse_part.float())  # [L, Hq]; -inf only where both are empty
    shift = torch.where(torch.isneginf(new), torch.zeros_like(new), new)
    w_held = torch.exp(held - shift).unsqueeze(-1)  # [L, Hq, 1]
    w_part = torch.exp(lse_part.float() - shift).unsqueeze(-1)
    if isinstance(rows, slice):  # a view: update in place
        out[rows].mul_(w_held).add_(o_part * w_part)
    else:
        out[rows] = out[rows] * w_held + o_part * w_part
    lse[rows] = new


def apply_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention sinks (GPT-OSS): one learned logit per query head joins that head's softmax denominator, once,
    after every partial is merged: with S = exp(lse) the keys' total, out * S / (S + exp(sink)) =
    out * sigmoid(lse - sink). The sink adds no value; a row with no key (lse = -inf) gets 0. Applying it per
    partial instead would count it once per shard (docs/context_parallel.md, "Windows, soft-capping and sinks")."""
    # out [N, Hq, D] float32, lse [N, Hq] float32, sinks [Hq] -> out [N, Hq, D] float32
    return out * torch.sigmoid(lse - sinks.float().to(lse.device)).unsqueeze(-1)
