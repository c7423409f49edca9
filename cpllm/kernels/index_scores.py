"""The lightning indexer's scores read in place from the paged index pool, in one C call
(cpllm/kernels/index_scores.c): each key once per query row, where it lies (no float32 copy of the context's
keys, no [rows, heads, T] products), and the keys a row may not see skipped (written -inf).

`index_scores` returns None where the kernel does not apply (kernels off or not built, built without AVX-512,
another device or dtype, an index head wider than 512) and the caller runs the torch form
(cpllm/layers/sparse_mla/indexer.py `masked_index_scores`). A slot outside the pool raises IndexError naming it
(nothing written); inputs whose sizes disagree raise ValueError.
"""

from __future__ import annotations

import torch

from cpllm.kernels.checks import NO_MEMORY, SLOT_OUT_OF_RANGE, check_shape, slot_error
from cpllm.kernels.decode_attention import POOL_DTYPES
from cpllm.kernels.library import load

MAX_WIDTH = 512
"""Widest index key the kernel's per-key buffer holds."""
NOT_BUILT_HERE = 2
"""The kernel's status where it was compiled without AVX-512."""


def index_scores(q: torch.Tensor, weights: torch.Tensor, index_pool: torch.Tensor, slots: torch.Tensor,
                 key_pos: torch.Tensor, query_pos: torch.Tensor, scale: float) -> torch.Tensor | None:
    """q [L, Hi, D] float32, weights [L, Hi] float32, index_pool [slots, 1, D], slots and key_pos [T] long,
    query_pos [L] long -> scores [L, T] float32 (-inf where key_pos > query_pos), or None (see the module)."""
    rows, heads, width = q.shape
    if not (q.device.type == index_pool.device.type == "cpu" and q.dtype == weights.dtype == torch.float32
            and index_pool.dtype in POOL_DTYPES and width <= MAX_WIDTH and index_pool.stride(-1) == 1
            and not torch.compiler.is_compiling()):
        return None
    lib = load("index_scores")
    if lib is None:
        return None
    check_shape("index scores", index_pool.shape[-1] == width and weights.shape == (rows, heads)
                and slots.shape == key_pos.shape and query_pos.shape == (rows,),
                f"q {tuple(q.shape)}, weights {tuple(weights.shape)}, pool {tuple(index_pool.shape)}, slots "
                f"{tuple(slots.shape)}, key positions {tuple(key_pos.shape)} and query positions "
                f"{tuple(query_pos.shape)} do not fit together")
    if not (q.stride(2) == 1 and q.stride(1) == width):
        q = q.contiguous()
    weights, slots, key_pos, query_pos = (x.contiguous() for x in (weights, slots.long(), key_pos.long(),
                                                                    query_pos.long()))
    out = torch.empty(rows, slots.numel(), dtype=torch.float32)
    status = lib.cpllm_index_scores(q.data_ptr(), q.stride(0), weights.data_ptr(), rows, heads, width,
                                    index_pool.data_ptr(), POOL_DTYPES[index_pool.dtype], index_pool.stride(0),
                                    index_pool.shape[0], slots.data_ptr(), key_pos.data_ptr(), slots.numel(),
                                    query_pos.data_ptr(), scale, torch.get_num_threads(), out.data_ptr())
    if status == NOT_BUILT_HERE:
        return None
    if status == SLOT_OUT_OF_RANGE:
        raise slot_error("index scores", slots, index_pool.shape[0])
    if status == NO_MEMORY:
        raise MemoryError(f"index scores kernel: no memory for {rows} rows of {heads} x {width} queries")
    check_shape("index scores", status == 0, f"status {status} for heads {heads}, width {width}")
    return out
