"""Decode attention in Triton, read in place from the paged K/V pools through each request's slot table.

One program attends one request's single query token, for all the query heads of one KV head (grouped-query
attention: each K/V row is loaded once for its G query heads), to one split of the request's context: slots
`[s * split_len, (s + 1) * split_len)` of its row of the slot table, cut at its length. Each split keeps an online
softmax in float32 and writes a partial (out, lse); a second kernel merges the splits exactly (the log-sum-exp
merge of docs/context_parallel.md, "Exact merge"), so a long context is read by many programs at once (split-K,
for small batches that would leave most of the GPU idle). The result is float32 out [B, Hq, D] and lse [B, Hq]:
what the CP layer merges with other ranks' partials. A request with no context gets (0, -inf).

The grid is fixed by (B, Hkv, splits) and the slot table's width, never by the lengths, which the kernels read
from device memory: a CUDA graph captured for a batch size replays for any lengths up to that width
(cpllm/model/execution/cuda_graphs.py). Runs on CUDA, and on the CPU under Triton's interpreter (TRITON_INTERPRET=1, set
before triton is imported), which is how tests/test_triton_attention.py checks it against float64 attention.

Before a launch the wrapper checks the shapes, dtypes and devices, then the values the kernels follow into memory:
each length within the slot table's width, each slot a request reads within the pool (triton_checks.py; errors
name the value and the limit, as the C kernels' do). `available()` also reads the kernels' kill switch
(CPLLM_KERNELS=0, library.py) at each call, so the gqa-triton backend then sends every call to its torch path.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading

import torch

from cpllm.kernels import library
from cpllm.kernels.triton_checks import check_decode_tables, check_index_tensor

POOL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""K/V pool dtypes the kernels read (widened to float32 as they are read where the query is float32)."""

BLOCK_N = 32
"""Context positions one loop iteration of a program reads."""
MIN_SPLIT = 256
"""Fewest context positions worth a split of their own (below this the merge costs more than it spreads)."""
MAX_SPLITS = 64
"""Most splits of one request's context."""
TARGET_PROGRAMS = 264
"""Programs to aim for (twice the SMs of an H100/H200): the split count grows until B * Hkv * splits reaches it."""


@functools.cache
def _triton():
    """triton and triton.language, imported on first use (never at cpllm's import: the CPU install has no triton)."""
    import triton
    import triton.language as tl
    return triton, tl


def available() -> bool:
    """triton imports (the `cuda` extra, or the interpreter tests' `triton` extra) and the kernels are not switched
    off (CPLLM_KERNELS=0, read now: library.enabled)."""
    if not library.enabled():
        return False
    try:
        _triton()
    except ImportError:
        return False
    return True


def next_pow2(n: int, least: int = 16) -> int:
    """The smallest power of two >= n and >= least (tl.dot wants every dimension of at least 16)."""
    return max(least, 1 << max(int(n) - 1, 0).bit_length())


def split_count(batch: int, kv_heads: int, width: int) -> int:
    """Splits of each request's context for a batch of `batch` requests, `kv_heads` KV heads and a slot table of
    `width` positions: enough programs to fill the GPU, each reading at least MIN_SPLIT positions."""
    by_length = max(1, -(-width // MIN_SPLIT))
    by_programs = max(1, -(-TARGET_PROGRAMS // max(1, batch * kv_heads)))
    return max(1, min(MAX_SPLITS, by_length, by_programs))


def interpreting() -> bool:
    """Triton's interpreter runs the kernels (on the CPU, with NumPy)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


_INTERPRETER_LOCK = threading.Lock()
"""Triton's interpreter patches triton.language while a kernel runs, so two threads (the simulated CP ranks of
scripts/gpu_check.py) must not run kernels at once under it."""


def launch_guard():
    """A context for one kernel launch: the interpreter's lock when interpreting, else nothing."""
    return _INTERPRETER_LOCK if interpreting() else contextlib.nullcontext()


def widen(dtype: torch.dtype) -> bool:
    """The kernels' matrix products run in float32 (IEEE, no TF32): for float32 queries, and for every dtype
    under the interpreter, whose tl.dot misreads bfloat16 operands (triton 3.9; the products of bf16 values are
    exact in float32, so the test still checks the kernels' logic). Else bf16/fp16 tensor-core products with
    float32 accumulation."""
    return dtype == torch.float32 or interpreting()


def _kernels():
    """(split kernel, merge kernel), from the module that imports triton (imported here, on first use)."""
    from cpllm.kernels import triton_decode_kernels as kernels
    return kernels.decode_split_kernel, kernels.merge_splits_kernel


_KERNEL = "triton decode attention"
"""How the errors of the value checks name this kernel."""


def _check(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor,
           lengths: torch.Tensor) -> None:
    """Shapes, dtypes and devices that fit together, then every length and read slot within its limit."""
    if q.dim() != 3 or k_pool.dim() != 3 or k_pool.shape != v_pool.shape:
        raise ValueError(f"decode attention wants q [B, Hq, D] and pools [N, Hkv, D] alike; got q {tuple(q.shape)}, "
                         f"k_pool {tuple(k_pool.shape)}, v_pool {tuple(v_pool.shape)}")
    if q.shape[2] != k_pool.shape[2] or q.shape[1] % k_pool.shape[1]:
        raise ValueError(f"decode attention: q {tuple(q.shape)} does not fit pools {tuple(k_pool.shape)} (head size "
                         "must agree, query heads must be a multiple of KV heads)")
    if slots.dim() != 2 or slots.shape[0] != q.shape[0] or lengths.shape != (q.shape[0],):
        raise ValueError(f"decode attention: slots {tuple(slots.shape)} and lengths {tuple(lengths.shape)} do not "
                         f"match a batch of {q.shape[0]}")
    if k_pool.dtype not in POOL_DTYPES or v_pool.dtype != k_pool.dtype:
        raise ValueError(f"decode attention reads pools of {POOL_DTYPES}, got {k_pool.dtype} / {v_pool.dtype}")
    if k_pool.stride(2) != 1 or v_pool.stride(2) != 1:
        raise ValueError("decode attention reads pools whose rows are contiguous along the head size")
    if q.device != k_pool.device or v_pool.device != k_pool.device:
        raise ValueError(f"decode attention: q on {q.device}, pools on {k_pool.device} / {v_pool.device}")
    check_index_tensor(_KERNEL, "slots", slots, k_pool.device)
    check_index_tensor(_KERNEL, "lengths", lengths, k_pool.device)
    check_decode_tables(_KERNEL, slots, lengths, k_pool.shape[0])


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor,
                           lengths: torch.Tensor, scale: float,
                           splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's query against its own context, slots[b, :lengths[b]] of the pools, read in place.

    q [B, Hq, D] (float32, bfloat16, float16), pools [N, Hkv, D], slots [B, W] and lengths [B] (integers) ->
    out [B, Hq, D] float32, lse [B, Hq] float32; (0, -inf) for a row of length 0. `splits` (default
    `split_count`) cuts each context into that many runs of positions, merged exactly by the second kernel."""
    _check(q, k_pool, v_pool, slots, lengths)
    split_kernel, merge_kernel = _kernels()
    batch, heads, head_dim = q.shape
    kv_heads, width = k_pool.shape[1], slots.shape[1]
    group = heads // kv_heads
    splits = split_count(batch, kv_heads, width) if splits is None else max(1, int(splits))
    split_len = -(-max(-(-width // splits), 1) // BLOCK_N) * BLOCK_N
    splits = max(1, -(-width // split_len))
    q, slots, lengths = q.contiguous(), slots.contiguous(), lengths.contiguous()
    part = torch.empty(batch, heads, splits, head_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(batch, heads, splits, dtype=torch.float32, device=q.device)
    if batch == 0:
        return part[:, :, 0], part_lse[:, :, 0]
    block_d = next_pow2(head_dim)
    with launch_guard():
        split_kernel[(batch, kv_heads, splits)](
            q, k_pool, v_pool, slots, lengths, part, part_lse, float(scale), split_len,
            q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
            slots.stride(0), part.stride(0), part.stride(1), part.stride(2), part_lse.stride(0), part_lse.stride(1),
            GROUP=group, HEAD_DIM=head_dim, BLOCK_G=next_pow2(group), BLOCK_D=block_d, BLOCK_N=BLOCK_N,
            WIDEN=widen(q.dtype))
    if splits == 1:
        return part[:, :, 0], part_lse[:, :, 0]
    out = torch.empty(batch, heads, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(batch, heads, dtype=torch.float32, device=q.device)
    with launch_guard():
        merge_kernel[(batch, heads)](
            part, part_lse, out, lse, splits, part.stride(0), part.stride(1), part.stride(2), part_lse.stride(0),
            part_lse.stride(1), out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=next_pow2(splits, least=2))
    return out, lse
