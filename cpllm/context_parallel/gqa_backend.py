"""Grouped-query attention over the paged K/V pools: the `AttentionBackend` of the Llama family.

Its implementations live in local_attention.py: the C kernels on CPU (prefill attention, decode attention reading
each request's slots in place, the row store), the fused SDPA kernels elsewhere (sdpa.py: CPU flash, the CUDA
efficient kernel), and the forms a compiled decode graph calls. Each call picks among them from its tensors
(device, dtypes, the decode batch's form); the CP layer never sees which ran.
"""

from __future__ import annotations

import torch

from cpllm.context_parallel import local_attention
from cpllm.kernels import decode_attention
from cpllm.kernels.decode_attention import POOL_DTYPES
from cpllm.kernels.decode_rows import store_rows_


def _store_kv(k_pool, v_pool, slots, k, v, rows) -> None:
    # one C call per pool on eager CPU steps; else index_copy_, several times cheaper than advanced indexing here
    if not store_rows_(k_pool, slots, k, rows):
        k_pool.index_copy_(0, slots, k.index_select(0, rows).to(k_pool.dtype))
    if not store_rows_(v_pool, slots, v, rows):
        v_pool.index_copy_(0, slots, v.index_select(0, rows).to(v_pool.dtype))


def _context_keys(k_pool, v_pool, slots, dtype):
    # index_select: far cheaper than advanced indexing
    return k_pool.index_select(0, slots).to(dtype), v_pool.index_select(0, slots).to(dtype)  # [S, Hkv, D] each


class GQAPagedBackend:
    """Query heads in groups over shared K/V heads, K/V rows of [Hkv, D] in the pools (see the module)."""

    name = "gqa"
    # The module's functions as they are (no wrapper frame on the per-layer path).
    store_kv = staticmethod(_store_kv)
    attend = staticmethod(local_attention.attend)
    context_keys = staticmethod(_context_keys)
    attend_decode = staticmethod(local_attention.attend_decode)
    attend_decode_whole = staticmethod(local_attention.attend_pooled_single_tokens)
    decode_context = staticmethod(local_attention.gather_context)
    attend_gathered_decode = staticmethod(local_attention.attend_single_tokens)

    @staticmethod
    def reads_decode_rows_in_place(device: torch.device, pool_dtype: torch.dtype) -> bool:
        """The C decode kernel reads each request's own slots (faster than the shared-key union's gather,
        docs/benchmarks.md) where it was built, on CPU pools of a dtype it reads."""
        return device.type == "cpu" and pool_dtype in POOL_DTYPES and decode_attention.built()
