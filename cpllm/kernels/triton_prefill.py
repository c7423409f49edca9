"""Prefill attention in Triton: a chunk's queries against its cached context, read in place through the slot
table, and causally against the chunk's own new keys, in one pass.

One program attends BLOCK_M consecutive queries of one query head (FlashAttention-2's forward: online softmax in
float32 over blocks of keys), first over the context keys (pool rows at `slots`, every query sees every one),
then over the new keys (query i sees new keys 0..i; the loop stops at the block's last row). Out [L, Hq, D] and
lse [L, Hq] are float32: the partial the CP layer merges with the other ranks' and pieces' (a row that sees no
key gets (0, -inf)). The same kernel serves the backend protocol's plain `attend` (keys given as a tensor: no
slot table, `slots=None`). Tested on the CPU under Triton's interpreter (tests/test_triton_attention.py).
Before a launch the wrapper checks shapes, dtypes and devices, and every slot against the pool (triton_checks.py).
"""

from __future__ import annotations

import torch

from cpllm.kernels.triton_attention import POOL_DTYPES, launch_guard, next_pow2, widen
from cpllm.kernels.triton_checks import check_index_tensor, check_slots

_KERNEL = "triton prefill attention"
"""How the errors of the value checks name this kernel."""


def _blocks(head_dim: int, wide: bool) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) for a head size: smaller tiles for wide heads, so q, k, v and acc fit in registers and
    shared memory (float32 operands, `wide`, take twice the bytes: 256-wide heads then stay under the 164 KiB an
    A100 block may use; sm_90 compiles measured 168 KiB with 32 x 32 tiles)."""
    if head_dim <= 64:
        return 64, 64
    if head_dim <= 128:
        return 64, 32
    return (32, 16) if wide else (32, 32)


def _check(q, ctx_k, ctx_v, slots, new_k, new_v) -> None:
    """Shapes, dtypes and devices that fit together, then every slot within the pool."""
    if q.dim() != 3 or ctx_k.dim() != 3 or ctx_k.shape != ctx_v.shape:
        raise ValueError(f"prefill attention wants q [L, Hq, D] and context [S, Hkv, D] alike; got q "
                         f"{tuple(q.shape)}, k {tuple(ctx_k.shape)}, v {tuple(ctx_v.shape)}")
    if q.shape[2] != ctx_k.shape[2] or q.shape[1] % ctx_k.shape[1]:
        raise ValueError(f"prefill attention: q {tuple(q.shape)} does not fit keys {tuple(ctx_k.shape)} (head size "
                         "must agree, query heads must be a multiple of KV heads)")
    if ctx_k.dtype not in POOL_DTYPES or ctx_v.dtype != ctx_k.dtype:
        raise ValueError(f"prefill attention reads keys of {POOL_DTYPES}, got {ctx_k.dtype} / {ctx_v.dtype}")
    if slots is not None and slots.dim() != 1:
        raise ValueError(f"prefill attention: slots must be [S], got {tuple(slots.shape)}")
    if (new_k is None) != (new_v is None):
        raise ValueError("prefill attention: give new_k and new_v together")
    if new_k is not None:
        if new_k.shape != new_v.shape or new_k.shape[0] != q.shape[0] or new_k.shape[1:] != ctx_k.shape[1:]:
            raise ValueError(f"prefill attention: new keys {tuple(new_k.shape)} / {tuple(new_v.shape)} must be "
                             f"[L, Hkv, D] for q {tuple(q.shape)} and context {tuple(ctx_k.shape)}")
    devices = {t.device for t in (q, ctx_k, ctx_v, new_k, new_v) if t is not None}
    if len(devices) > 1:
        raise ValueError(f"prefill attention: q, keys and values on several devices ({sorted(map(str, devices))})")
    if slots is not None:
        check_index_tensor(_KERNEL, "slots", slots, ctx_k.device)
        check_slots(_KERNEL, slots, ctx_k.shape[0])


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t with its last dimension contiguous (what the kernel's pointer arithmetic assumes)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def prefill_attention(q: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor, scale: float, *,
                      slots: torch.Tensor | None = None, new_k: torch.Tensor | None = None,
                      new_v: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [L, Hq, D] against the context keys (ctx_k/ctx_v [N, Hkv, D]: the pools, read at `slots` [S], or the
    keys themselves where `slots` is None) and, given `new_k`/`new_v` [L, Hkv, D], causally against those ->
    out [L, Hq, D] float32, lse [L, Hq] float32."""
    _check(q, ctx_k, ctx_v, slots, new_k, new_v)
    from cpllm.kernels.triton_prefill_kernels import prefill_kernel

    num_q, heads, head_dim = q.shape
    group = heads // ctx_k.shape[1]
    out = torch.empty(num_q, heads, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(num_q, heads, dtype=torch.float32, device=q.device)
    if num_q == 0:
        return out, lse
    q, ctx_k, ctx_v = _rows(q), _rows(ctx_k), _rows(ctx_v)
    ctx_len = ctx_k.shape[0] if slots is None else slots.shape[0]
    slot_table = slots.contiguous() if slots is not None else ctx_k  # an unread pointer where USE_SLOTS is off
    num_new = 0
    if new_k is None:
        new_k, new_v = ctx_k, ctx_v  # unread (num_new = 0)
    else:
        new_k, new_v, num_new = _rows(new_k.to(ctx_k.dtype)), _rows(new_v.to(ctx_k.dtype)), new_k.shape[0]
    block_m, block_n = _blocks(head_dim, widen(q.dtype))
    with launch_guard():
        prefill_kernel[(-(-num_q // block_m), heads)](
            q, ctx_k, ctx_v, slot_table, new_k, new_v, out, lse, float(scale), num_q, ctx_len, num_new,
            q.stride(0), q.stride(1), ctx_k.stride(0), ctx_k.stride(1), ctx_v.stride(0), ctx_v.stride(1),
            new_k.stride(0), new_k.stride(1), new_v.stride(0), new_v.stride(1), out.stride(0), out.stride(1),
            lse.stride(0),
            GROUP=group, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=next_pow2(head_dim),
            USE_SLOTS=slots is not None, WIDEN=widen(q.dtype))
    return out, lse
