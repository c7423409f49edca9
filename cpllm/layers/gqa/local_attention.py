"""The GQA backend's implementations (backend.py): the C kernels, SDPA, the compiled-graph forms."""

from __future__ import annotations

from typing import NamedTuple

import torch

from cpllm.layers.gqa.shared_keys import shared_key_view
from cpllm.context_parallel.sdpa import attention_with_lse
from cpllm.kernels.decode_attention import applies as kernel_applies
from cpllm.kernels.decode_attention import paged_decode_attention
from cpllm.kernels.prefill_attention import prefill_attention


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
           bf16_products: bool = False, causal_offset: int | torch.Tensor = 0, out_dtype: torch.dtype | None = None):
    # q [L, Hq, D], k/v [S, Hkv, D] -> out [L, Hq, D], lse [L, Hq]; causal: query i sees keys j <= i + causal_offset
    # (one int, or an int tensor [L] of each query's own offset); out_dtype bfloat16: out rounded so where the C
    # kernel runs (the caller rounds it anyway), else out as it comes
    if q.shape[0] and k.shape[0]:
        fast = prefill_attention(q, k, v, scale, causal, bf16_products, causal_offset,
                                 out_dtype=out_dtype or torch.float32)  # the C kernel, else None
        if fast is not None:
            return fast
    mask = None
    per_row = isinstance(causal_offset, torch.Tensor)
    if causal and (per_row or causal_offset):  # SDPA's flag is top-left aligned only: a keep-mask for the offset
        keys, queries = torch.arange(k.shape[0], device=q.device), torch.arange(q.shape[0], device=q.device)
        offsets = causal_offset.to(q.device)[:, None] if per_row else causal_offset
        mask = keys[None, :] <= queries[:, None] + offsets  # [L, S]
    out, lse = attention_with_lse(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
        scale=scale, causal=causal and mask is None, mask=mask,
    )
    return out[0].transpose(0, 1), lse[0].transpose(0, 1)


BF16_MIN_PAIRS = 256 * 256
"""Query-key pairs from which `attend_bf16` rounds to bf16: below, a call costs little in float32 (about a
millisecond per layer on one core), so short prompts and short pieces keep float32's accuracy."""


def attend_bf16(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
                causal_offset: int | torch.Tensor = 0, out_dtype: torch.dtype | None = None):
    """`attend` on bf16 dot products where the C kernel runs them (cpllm/kernels/prefill_attention.py), for
    calls of at least BF16_MIN_PAIRS query-key pairs."""
    return attend(q, k, v, scale, causal, q.shape[0] * k.shape[0] >= BF16_MIN_PAIRS, causal_offset, out_dtype)


def attend_single_tokens(q, k_ctx, v_ctx, decode, scale: float, every_row_sees_a_key: bool = False,
                         score_mod=None):
    # q [B, Hq, D] -> out [B, Hq, D], lse [B, Hq]
    if decode.shared_keys:  # the B queries are the rows of one sequence over the union of keys
        out, lse = attention_with_lse(q.transpose(0, 1).unsqueeze(0), k_ctx, v_ctx, scale=scale,
                                      mask=decode.key_mask, every_row_sees_a_key=every_row_sees_a_key,
                                      score_mod=score_mod)  # [1, Hq, B, D], [1, Hq, B]
        return out[0].transpose(0, 1), lse[0].transpose(0, 1)
    out, lse = attention_with_lse(q.unsqueeze(2), k_ctx, v_ctx, scale=scale, mask=decode.key_mask,
                                  every_row_sees_a_key=every_row_sees_a_key,
                                  score_mod=score_mod)  # [B, Hq, 1, D], [B, Hq, 1]
    return out[:, :, 0], lse[:, :, 0]


def _gathered_rows(pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    # pool [num_slots, Hkv, D], slots [B, L] -> rows [B, L, Hkv, D]
    return pool.index_select(0, slots.reshape(-1)).view(*slots.shape, *pool.shape[1:])  # far cheaper than pool[slots]


def gather_context(pool: torch.Tensor, decode, dtype: torch.dtype | None = None) -> torch.Tensor:
    # pool [num_slots, Hkv, D] -> the context of decode.slots [B, L] as [B, Hkv, L, D], in `dtype` (None: the pool's)
    if decode.window is not None:  # consecutive slots: a view of the pool, nothing copied (unless cast)
        first, count = decode.window
        rows = pool.narrow(0, first, count).unsqueeze(0)
    else:
        rows = _gathered_rows(pool, decode.slots)
    return (rows if dtype is None else rows.to(dtype)).transpose(1, 2)


def attend_decode(q, k_pool, v_pool, decode, scale: float, every_row_sees_a_key: bool = False,
                  score_mod=None):
    """Single-token queries against this rank's share of their context in the pools -> out [B, Hq, D], lse [B, Hq].

    Where the C kernel runs it reads each request's own slots in place, shared prefix or not (several times faster
    than gathering them and calling the flash kernel, and faster than the shared-key union: docs/benchmarks.md).
    Elsewhere (no kernel, CUDA, CPLLM_KERNELS=0) the context is gathered, in the batch's shared-key view where
    requests share a prefix (built once per step: `sdpa_form`), and attention_with_lse runs. A request with no
    local context gets (0, -inf). With `score_mod` (a layer's score modifier: the kernel takes none) the gathered path's math runs."""
    if score_mod is None and _kernel_applies(q, k_pool, decode):
        return paged_decode_attention(q, k_pool, v_pool, decode.slots, decode.lengths, scale)
    decode = sdpa_form(decode)
    k_ctx, v_ctx = gather_context(k_pool, decode, q.dtype), gather_context(v_pool, decode, q.dtype)
    return attend_single_tokens(q, k_ctx, v_ctx, decode, scale, every_row_sees_a_key, score_mod)


def sdpa_form(decode):
    """The form of a decode batch the SDPA implementations read: its shared-key view where its requests share a
    prefix and the union pays (shared_keys.py `shared_key_view`: built on the step's first call, then cached), else
    the batch itself (each request's own slots, padded)."""
    if getattr(decode, "shared_prefix", None) is None:  # own slots only, a view already, or a compiled op's keys
        return decode
    view = shared_key_view(decode)
    return decode if view is None else view


def decode_form(decode, k_pool: torch.Tensor):
    """The form of a step's decode batch these pools' decode attention reads: the batch itself where the C kernel
    runs (CPU pools of a dtype it reads, kernel built), else `sdpa_form`. For a compiled step, which asks once
    before its graphs run (they cannot build the view)."""
    if decode is None or kernel_applies(k_pool, k_pool):  # q shares the pool's device; its dtype is one of the pools'
        return decode
    return sdpa_form(decode)


def gather_decode_context(pool: torch.Tensor, decode, dtype: torch.dtype) -> torch.Tensor:
    """The decode rows' context gathered once for several query blocks (pass-Q), in `sdpa_form`."""
    return gather_context(pool, sdpa_form(decode), dtype)


def attend_gathered_decode(q, k_ctx, v_ctx, decode, scale: float, score_mod=None):
    """Decode rows against contexts from `gather_decode_context` (the same cached form)."""
    return attend_single_tokens(q, k_ctx, v_ctx, sdpa_form(decode), scale, score_mod=score_mod)


def attend_pooled_single_tokens(q, k_pool, v_pool, decode, scale: float) -> torch.Tensor:
    """Single-token queries against their whole context in these pools: each query sees at least itself, so no
    partial is merged and only out [B, Hq, D] returns."""
    if torch.compiler.is_compiling():  # the compiled decode step (cpllm/model/execution/decode_graph.py)
        if _kernel_applies(q, k_pool, decode):  # the C kernel, as one opaque op of the graph
            return pooled_decode_attention(q, k_pool, v_pool, decode.slots, decode.lengths, decode.key_mask,
                                           decode.shared_keys, scale)
        if decode.slots.shape[0] == 1 and decode.key_mask is None:  # one request: inductor fuses this into one
            # pass over the context in the pool's dtype: a view of the pool, or rows gathered by an opaque op (fused
            # into the loops, the gather would become indirect loads, measured several times slower)
            if decode.window is not None:
                k_ctx, v_ctx = gather_context(k_pool, decode), gather_context(v_pool, decode)
            else:
                k_ctx, v_ctx = (gather_slots(pool, decode.slots).transpose(1, 2) for pool in (k_pool, v_pool))
            return reduction_attention(q.unsqueeze(2), k_ctx, v_ctx, scale, None)[:, :, 0]
        # Several requests: the fused kernel, as one opaque op of the graph (written as sums, a batch of queries
        # computes poorly, and shared keys would be read once per query: measured several times slower).
        return pooled_decode_attention(q, k_pool, v_pool, decode.slots, decode.lengths, decode.key_mask,
                                       decode.shared_keys, scale)
    return attend_decode(q, k_pool, v_pool, decode, scale, every_row_sees_a_key=True)[0]


def _kernel_applies(q, k_pool, decode) -> bool:
    """The C kernel takes this batch: its own slots per request (not shared keys), on a device and dtype it reads."""
    return not decode.shared_keys and decode.lengths is not None and kernel_applies(q, k_pool)


@torch.library.custom_op("cpllm::gather_slots", mutates_args=())
def gather_slots(pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """pool [num_slots, Hkv, D], slots [B, L] -> rows [B, L, Hkv, D] (an op a compiled graph calls as is)."""
    return _gathered_rows(pool, slots)


@gather_slots.register_fake
def _(pool, slots):
    return pool.new_empty((*slots.shape, *pool.shape[1:]))


class _Keys(NamedTuple):
    """The fields of DecodeBatch that attend_decode reads."""

    slots: torch.Tensor
    key_mask: torch.Tensor | None
    shared_keys: bool
    lengths: torch.Tensor | None
    window: tuple[int, int] | None = None


@torch.library.custom_op("cpllm::pooled_decode_attention", mutates_args=())
def pooled_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor,
                            lengths: torch.Tensor | None, key_mask: torch.Tensor | None, shared_keys: bool,
                            scale: float) -> torch.Tensor:
    """attend_pooled_single_tokens' eager path, as one op a compiled graph calls as is."""
    # q [B, Hq, D], slots [B, L] (or [1, U] with shared keys) -> out [B, Hq, D]
    out, _ = attend_decode(q, k_pool, v_pool, _Keys(slots, key_mask, shared_keys, lengths), scale,
                           every_row_sees_a_key=True)
    return out.contiguous()


@pooled_decode_attention.register_fake
def _(q, k_pool, v_pool, slots, lengths, key_mask, shared_keys, scale):
    return torch.empty_like(q)


def reduction_attention(q, k, v, scale: float, mask: torch.Tensor | None) -> torch.Tensor:
    """Softmax attention in float32 written as broadcast products and sums, for a compiled graph: inductor fuses
    the whole layer's attention, K/V store included, into one generated loop nest that reads K and V in place in
    the pool (batched matmuls over the pool's strided layout measured 1.2x slower at 2,048 keys). Eager, this would
    materialize [.., S, D] products: the eager path calls the fused SDPA kernel instead. Every row must see a key."""
    # q [B, Hq, L, D], k/v [B, Hkv, S, D], mask additive, broadcastable to [B, Hq, L, S] -> out [B, Hq, L, D]
    b, hq, length, d = q.shape
    hkv, keys = k.shape[1], k.shape[2]
    qg = q.float().reshape(b, hkv, hq // hkv, length, 1, d)
    scores = (qg * k.float()[:, :, None, None]).sum(-1).reshape(b, hq, length, keys) * scale  # [B, Hq, L, S]
    if mask is not None:
        scores = scores + mask
    probs = torch.softmax(scores, dim=-1).reshape(b, hkv, hq // hkv, length, keys, 1)
    out = (probs * v.float()[:, :, None, None]).sum(-2)  # [B, Hkv, G, L, D]
    return out.reshape(b, hq, length, d).to(q.dtype)
