"""Scaled dot-product attention that also returns the log-sum-exp.

Context parallelism merges partial attentions (merge.py), which needs each
partial's log-sum-exp. Backends:
- CPU: `aten._scaled_dot_product_flash_attention_for_cpu`. It takes GQA
  directly, float masks only, its causal flag is top-left aligned, and a row
  whose keys are all masked comes back with lse = 0 (docs/context_parallel.md, "Exact merge"). It
  crashes the process (SIGFPE) on an empty query or key dimension, so those
  cases never reach it.
- CUDA: `aten._scaled_dot_product_efficient_attention` (masks, fp32, returns
  lse) with K/V expanded for GQA. Whether it applies is decided up front by
  PyTorch's own check (`torch.backends.cuda.can_use_efficient_attention`);
  where it does not, the matmul path (which builds the whole score matrix) is
  used deliberately and a WARNING naming the reason is logged once per reason.
  An error raised by the kernel itself propagates: there is no silent fallback.
- Other devices: the matmul path, with the same one-time WARNING.
Fully masked rows are fixed up the same way on every path: out = 0, lse = -inf.

Masks are additive floats broadcastable to [B, Hq, L, S] (0 keeps, -inf drops);
a boolean mask (True keeps, as in SDPA) is converted. `causal=True` is
top-left aligned (query i sees keys j <= i); for queries that sit at an offset
use `causal_offset_mask` instead.
"""

from __future__ import annotations

from typing import Callable

import logging
import warnings

import torch

logger = logging.getLogger(__name__)

_warned: set[str] = set()
"""Reasons already logged for using the matmul path instead of a fused kernel (each is logged once)."""


def _warn_once(reason: str, example: str = "") -> None:
    """One WARNING per distinct reason (not per call, nor per shape); `example` names the first inputs it hit."""
    if reason not in _warned:
        _warned.add(reason)
        logger.warning("attention: %s%s; using the matmul path instead, which builds the whole [L, S] score "
                       "matrix (slow and memory-hungry for long prompts). Logged once.", reason, example)


def causal_offset_mask(
    q_positions: torch.Tensor, k_positions: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Additive mask [L, S]: 0 where `k_positions[j] <= q_positions[i]`, else -inf."""
    keep = k_positions.unsqueeze(0) <= q_positions.unsqueeze(1)  # [L, S]
    mask = torch.zeros(keep.shape, dtype=dtype, device=q_positions.device)
    return mask.masked_fill_(~keep, float("-inf"))


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k, v must be [B, H, L, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape != v.shape:
        raise ValueError(f"k shape {tuple(k.shape)} differs from v shape {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on batch or head_dim")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"query heads {q.shape[1]} must be a multiple of KV heads {k.shape[1]}")


def _float_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    return mask.to(dtype)


def _fully_masked_rows(
    mask: torch.Tensor | None, causal: bool, shape: tuple[int, int, int, int]
) -> torch.Tensor | None:
    """Bool [B, Hq, L] (broadcast view) of rows with no visible key, or None if there are none."""
    if mask is None:
        return None  # top-left causal always shows key 0 when S > 0
    batch, heads, q_len, k_len = shape
    keep = ~torch.isneginf(mask)
    if causal:
        keep = keep & torch.ones(q_len, k_len, dtype=torch.bool, device=mask.device).tril()
    empty = ~keep.any(dim=-1)  # [..., L] broadcastable to [B, Hq, L]
    if not bool(empty.any()):
        return None
    while empty.dim() < 3:
        empty = empty.unsqueeze(0)
    return empty.expand(batch, heads, q_len)


def _empty_result(q: torch.Tensor, k_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    batch, heads, q_len, _ = q.shape
    lse_fill = float("-inf") if k_len == 0 else 0.0
    out = torch.zeros_like(q, memory_format=torch.contiguous_format)
    lse = torch.full((batch, heads, q_len), lse_fill, dtype=torch.float32, device=q.device)
    return out, lse


def _cpu_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=mask, scale=scale
    )
    return out, lse


def _expand_kv(k: torch.Tensor, groups: int) -> torch.Tensor:
    # Query head h uses KV head h // groups (same convention as the CPU kernel).
    return k if groups == 1 else k.repeat_interleave(groups, dim=1)


def _efficient_unsupported(q, k, v, bias, causal: bool) -> str | None:
    """None when the memory-efficient kernel applies to these inputs, else PyTorch's reason."""
    params = torch.backends.cuda.SDPAParams(q, k, v, bias, 0.0, causal, False)
    if torch.backends.cuda.can_use_efficient_attention(params, debug=False):
        return None
    with warnings.catch_warnings(record=True) as caught:  # debug=True says why, as warnings
        warnings.simplefilter("always")
        torch.backends.cuda.can_use_efficient_attention(params, debug=True)
    why = "; ".join(str(w.message).strip() for w in caught) or "no reason given"
    return (f"the CUDA memory-efficient attention kernel does not apply ({why}) to {q.dtype} inputs with "
            f"head_dim={q.shape[-1]}, mask={bias is not None}, causal={causal}")


def _cuda_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    groups = q.shape[1] // k.shape[1]
    k, v = _expand_kv(k, groups), _expand_kv(v, groups)
    bias = None
    if mask is not None:
        batch, heads, q_len, k_len = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
        # The kernel wants the bias rows 16-element aligned: pad, then slice a view.
        padded = -(-k_len // 16) * 16
        bias = torch.zeros(batch, heads, q_len, padded, dtype=q.dtype, device=q.device)
        bias[..., :k_len] = mask.to(q.dtype).expand(batch, heads, q_len, k_len)
        bias = bias[..., :k_len]
    reason = _efficient_unsupported(q, k, v, bias, causal)
    if reason is not None:
        _warn_once(reason, f" (first seen with q {tuple(q.shape)}, k {tuple(k.shape)})")
        return _math_attention(q, k, v, scale, mask, causal, torch.float32)
    # A RuntimeError here is a real failure (or a gap in the check above): let it surface.
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, bias, True, 0.0, causal, scale=scale
    )
    return out, lse[..., : q.shape[2]].float()


def _math_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None,
    causal: bool,
    compute_dtype: torch.dtype,
    score_mod: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    groups = q.shape[1] // k.shape[1]
    k, v = _expand_kv(k, groups), _expand_kv(v, groups)
    scores = torch.matmul(q.to(compute_dtype), k.to(compute_dtype).transpose(-1, -2)) * scale  # [B, H, L, S]
    if score_mod is not None:  # before the mask, so masked keys stay -inf (Gemma 2's soft-cap)
        scores = score_mod(scores)
    if mask is not None:
        scores = scores + mask.to(compute_dtype)
    if causal:
        q_len, k_len = scores.shape[-2:]
        keep = torch.ones(q_len, k_len, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, H, L], -inf on fully masked rows
    probs = torch.exp(scores - torch.where(torch.isneginf(lse), 0.0, lse).unsqueeze(-1))
    out = torch.matmul(probs, v.to(compute_dtype))
    return out, lse


def attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    mask: torch.Tensor | None = None,
    causal: bool = False,
    every_row_sees_a_key: bool = False,
    score_mod: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention and its log-sum-exp.

    `score_mod`: an elementwise function of the scaled scores [B, Hq, L, S], applied before the mask (a layer's
    score modifier: Gemma 2's soft-cap, cpllm/layers/window/modifier.py); no fused kernel takes one, so such a
    call runs the matmul path in float32 on every device.

    `every_row_sees_a_key`: the caller knows no query row is fully masked (a decode token sees itself), so the
    scan of the mask for such rows, and its host sync, are skipped.

    q: [B, Hq, L, D]; k, v: [B, Hkv, S, D] with Hq a multiple of Hkv.
    mask: additive float (or bool keep-mask) broadcastable to [B, Hq, L, S].
    Returns out [B, Hq, L, D] in q's dtype and lse [B, Hq, L] float32. Rows
    with no visible key (and every row when S == 0) give out = 0, lse = -inf.
    """
    _check_shapes(q, k, v)
    k_len = k.shape[2]
    if k_len == 0 or q.numel() == 0:
        return _empty_result(q, k_len)
    if mask is not None and mask.device != q.device:
        raise ValueError(f"attention mask is on {mask.device} but q is on {q.device}: "
                         "move the step's metadata to the rank's device (AttentionMetadata.to)")
    fmask = _float_mask(mask, q.dtype)
    if score_mod is not None:
        out, lse = _math_attention(q, k, v, scale, fmask, causal, torch.float32, score_mod)
    elif q.device.type == "cpu":
        out, lse = _cpu_attention(q, k, v, scale, fmask, causal)
    elif q.device.type == "cuda":
        out, lse = _cuda_attention(q, k, v, scale, fmask, causal)
    else:
        _warn_once(f"no fused attention kernel with log-sum-exp for device type {q.device.type!r}")
        out, lse = _math_attention(q, k, v, scale, fmask, causal, torch.float32)
    out, lse = out.to(q.dtype), lse.float()
    if every_row_sees_a_key:
        return out, lse
    empty = _fully_masked_rows(fmask, causal, (q.shape[0], q.shape[1], q.shape[2], k_len))
    if empty is not None:
        lse = lse.masked_fill(empty, float("-inf"))
        out = out.masked_fill(empty.unsqueeze(-1), 0.0)
    return out, lse


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    mask: torch.Tensor | None = None,
    causal: bool = False,
    score_mod: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain float64 matmul + softmax, for tests. Same contract as `attention_with_lse`,
    but both results are float64 (out [B, Hq, L, D], lse [B, Hq, L])."""
    _check_shapes(q, k, v)
    if k.shape[2] == 0 or q.numel() == 0:
        out, lse = _empty_result(q, k.shape[2])
        return out.double(), lse.double()
    fmask = _float_mask(mask, torch.float64)
    out, lse = _math_attention(q, k, v, scale, fmask, causal, torch.float64, score_mod)
    empty = torch.isneginf(lse)
    return out.masked_fill(empty.unsqueeze(-1), 0.0), lse
