"""Decode attention read in place from the paged K/V pool (cpllm/kernels/decode_attention.c).

Each request's single query token attends to its own slots of the pool: no gathered copy of the context, every
KV head's row read once for all the query heads that share it (grouped-query attention), float32 accumulation,
float16 and bfloat16 pools widened as they are read. Where the kernel cannot run (kernels off, no compiler,
another device or dtype) `paged_decode_attention` returns None and the caller runs its torch path. Shapes that do
not fit together raise ValueError; a slot outside the pool or a length over the slot table's width, found by the
kernel as it reads them, raises before any pool row is read through it (cpllm/kernels/checks.py).
"""

from __future__ import annotations

import torch

from cpllm.kernels.checks import decode_attention_error
from cpllm.kernels.library import load

POOL_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
"""K/V pool dtypes the kernels read, with the code they take (KV_F32 / KV_F16 / KV_BF16 in the C sources)."""

_MIN_CHUNK, _MAX_CHUNK = 128, 2048
"""Bounds of the context positions one unit of work reads (a unit keeps its scores in a per-thread buffer)."""


@torch.compiler.assume_constant_result
def built() -> bool:
    """The kernel is on and built for this machine (builds it on the first call); a constant to a compiled graph."""
    return load("decode_attention") is not None


def _reads(q: torch.Tensor, k_pool: torch.Tensor) -> bool:
    """The kernel reads these devices and dtypes."""
    return (q.device.type == "cpu" and k_pool.device.type == "cpu" and k_pool.dtype in POOL_DTYPES
            and q.dtype in (torch.float32, torch.bfloat16, torch.float16))


def applies(q: torch.Tensor, k_pool: torch.Tensor) -> bool:
    """The kernel can run on these inputs (and is on and built)."""
    return _reads(q, k_pool) and built()


def positions_per_unit(batch: int, width: int, threads: int) -> int:
    """Positions per unit: about four units per thread over the batch when threads > 1, else whole requests."""
    units = 4 * threads if threads > 1 else batch
    per_unit = -(-batch * width // max(units, 1))
    return max(_MIN_CHUNK, min(_MAX_CHUNK, per_unit))


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor,
                           lengths: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """out [B, Hq, D] in q's dtype and lse [B, Hq] float32, or None where the kernel does not apply.

    q [B, Hq, D]; k_pool, v_pool [num_slots, Hkv, D]; slots [B, W] long, request b's context in slots[b, :lengths[b]];
    lengths [B] long, each at most W. A request with no context gets out 0 and lse -inf. Called once per layer and
    step, so it does no more than it must around the C call (about 10 us).
    """
    lib = load("decode_attention") if _reads(q, k_pool) else None
    if lib is None:
        return None
    batch, hq, d = q.shape
    num_slots, hkv, pool_head_dim = k_pool.shape
    if v_pool.dtype != k_pool.dtype or v_pool.shape != k_pool.shape or hq % hkv or pool_head_dim != d:
        raise ValueError(f"decode attention: q {tuple(q.shape)}, k_pool {tuple(k_pool.shape)} {k_pool.dtype}, "
                         f"v_pool {tuple(v_pool.shape)} {v_pool.dtype} do not fit together")
    requests, width = slots.shape
    if requests != batch or lengths.numel() != batch:
        raise ValueError(f"decode attention: slots {tuple(slots.shape)} and lengths {tuple(lengths.shape)} do not "
                         f"hold the {batch} requests of q {tuple(q.shape)}")
    if not (k_pool.is_contiguous() and v_pool.is_contiguous()):
        raise ValueError("decode attention reads the K/V pools in place: they must be contiguous")
    q32 = q if q.dtype == torch.float32 and q.is_contiguous() else q.float().contiguous()
    if slots.dtype != torch.int64 or not slots.is_contiguous() or lengths.dtype != torch.int64 \
            or not lengths.is_contiguous():
        slots, lengths = slots.to(torch.int64).contiguous(), lengths.to(torch.int64).contiguous()
    out = torch.empty(batch, hq, d, dtype=torch.float32)
    lse = torch.empty(batch, hq, dtype=torch.float32)
    if batch == 0:
        return out.to(q.dtype), lse
    threads = torch.get_num_threads()
    status = lib.cpllm_paged_decode_attention(
        q32.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), POOL_DTYPES[k_pool.dtype], num_slots, slots.data_ptr(),
        width, lengths.data_ptr(), batch, hq, hkv, d, scale, positions_per_unit(batch, width, threads), threads,
        out.data_ptr(), lse.data_ptr())
    if status != 0:
        raise decode_attention_error(status, slots, lengths, num_slots)
    return (out if q.dtype == torch.float32 else out.to(q.dtype)), lse
