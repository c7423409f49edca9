"""Grouped-query attention over the paged K/V pools: the `AttentionBackend` of the Llama family.

Its implementations live in local_attention.py: the C kernels on CPU (prefill attention, decode attention reading
each request's slots in place, the row store), the fused SDPA kernels elsewhere (sdpa.py: CPU flash, the CUDA
efficient kernel), and the forms a compiled decode graph calls. Each call picks among them from its tensors
(device, dtypes); the CP layer never sees which ran. The decode rows' metadata always holds each request's own
slots, which the C kernel reads in place; the SDPA path reads a batch sharing a prefix as one query block over the
union of its keys, a view built on its first use in a step and reused by every layer (`sdpa_form`).
"""

from __future__ import annotations

from cpllm.layers.gqa import local_attention
from cpllm.kernels.decode_rows import store_rows_
from cpllm.kernels.prefill_attention import has_bf16_products


def _store_kv(k_pool, v_pool, slots, k, v, rows) -> None:
    # one C call per pool on eager CPU steps; else index_copy_, several times cheaper than advanced indexing here
    if not store_rows_(k_pool, slots, k, rows):
        k_pool.index_copy_(0, slots, k.index_select(0, rows).to(k_pool.dtype))
    if not store_rows_(v_pool, slots, v, rows):
        v_pool.index_copy_(0, slots, v.index_select(0, rows).to(v_pool.dtype))


def _rows_to_move(k, v):
    return k, v  # K and V rows travel side by side


def _rows_moved(parts):
    return parts


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
    rows_to_move = staticmethod(_rows_to_move)
    rows_moved = staticmethod(_rows_moved)
    attend_decode = staticmethod(local_attention.attend_decode)
    attend_decode_whole = staticmethod(local_attention.attend_pooled_single_tokens)
    decode_context = staticmethod(local_attention.gather_decode_context)
    attend_gathered_decode = staticmethod(local_attention.attend_gathered_decode)
    decode_form = staticmethod(local_attention.decode_form)
    causal_offsets = True
    """`attend` takes `causal_offset=`: a query run and the keys before it in one kernel call (the CP layer's
    joined calls, cpllm/context_parallel/partition.py `joined_key_runs`)."""
    row_causal_offsets = True
    """`causal_offset=` may also be an int tensor, one offset per query: a PCP rank's head and tail runs of one
    prompt in one call against the prompt's keys in order (the CP layer's gathered prefill)."""
    narrow_output = True
    """`attend` takes `out_dtype=torch.bfloat16`: the output of a call whose result goes straight to a bf16 GEMM
    (no merge after it) written rounded, where the C kernel runs."""
    bf16_products = False
    """Prefill attention runs on bf16 dot products (`use_bf16_products`); False: float32, exact to its rounding."""

    def use_bf16_products(self) -> bool:
        """Prefill attention on bf16 products from now on, where a bf16 way pays on this CPU (AMX tiles or AVX-512
        BF16, measured once: kernels/prefill_attention.py `bf16_choice`); whether it does. For a model whose
        attention weights already run an approximate format (the caller's decision: the float32 path stays
        exact)."""
        if not has_bf16_products():
            return False
        self.attend = local_attention.attend_bf16  # shadows the class's function for this instance only
        self.bf16_products = True
        return True
