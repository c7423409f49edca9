"""Grouped-query attention over the paged pools with the Triton kernels: the `AttentionBackend` of CUDA ranks.

The same kind as `GQAPagedBackend` (cpllm/layers/gqa/backend.py), other kernels: decode rows read each
request's slots in place (cpllm/kernels/triton_attention.py, split-K with an exact merge), a prefill chunk's
cached context is read in place through its slot table and its own new keys causally
(cpllm/kernels/triton_prefill.py). Every answer is the float32 (out, lse) partial the CP layer merges. What the
kernels do not know (a decode with a score modifier; pass-Q's gathered decode contexts; the shared-key view) runs the GQA
backend's torch path on the same tensors, so every layer and layout runs, only slower there. A window's masked or
soft-capped prompt pieces never reach a backend (cpllm/layers/window/modifier.py).

The kernels run where triton imports and the tensors are on CUDA, or on the CPU under Triton's interpreter
(TRITON_INTERPRET=1, for the tests); anywhere else each call is the GQA backend's. `kind_for` is the choice of
the default kind per device (choice.py).
"""

from __future__ import annotations

import torch

from cpllm.kernels import triton_attention
from cpllm.kernels.triton_attention import POOL_DTYPES, paged_decode_attention
from cpllm.kernels.triton_prefill import prefill_attention
from cpllm.layers.gqa import local_attention
from cpllm.layers.gqa.backend import GQAPagedBackend


def runs_here(t: torch.Tensor) -> bool:
    """The kernels run on this tensor's device and dtype (CUDA, or the CPU under the interpreter)."""
    if t.dtype not in POOL_DTYPES or not triton_attention.available():
        return False
    return t.device.type == "cuda" or (t.device.type == "cpu" and triton_attention.interpreting())


class PagedKeys:
    """One request's cached keys (or values) left in the pool: the pool and the slots [S] to read, in `dtype`.
    What `context_keys` returns on the kernels' path, so `attend` reads the context in place; slicing it
    (a window's trimmed piece) slices the slots, and `tensor()` reads it out (the scored path)."""

    __slots__ = ("pool", "slots", "dtype")

    def __init__(self, pool: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype):
        self.pool, self.slots, self.dtype = pool, slots, dtype

    def __getitem__(self, index) -> "PagedKeys":
        return PagedKeys(self.pool, self.slots[index], self.dtype)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.slots.shape[0], *self.pool.shape[1:]))

    def tensor(self) -> torch.Tensor:
        return self.pool.index_select(0, self.slots).to(self.dtype)  # [S, Hkv, D]


def _tensor(keys) -> torch.Tensor:
    return keys.tensor() if isinstance(keys, PagedKeys) else keys


def _no_keys(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.zeros(q.shape, dtype=torch.float32, device=q.device),
            torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device))


_GQA = GQAPagedBackend


def _attend(q, k, v, scale: float, causal: bool):
    # q [L, Hq, D], k/v [S, Hkv, D] or PagedKeys -> out [L, Hq, D] float32, lse [L, Hq] float32
    paged = isinstance(k, PagedKeys)
    source = k.pool if paged else k
    if not runs_here(source) or q.dtype not in POOL_DTYPES or (causal and (paged or k.shape[0] != q.shape[0])):
        return _GQA.attend(q, _tensor(k), _tensor(v), scale, causal)
    if q.shape[0] == 0 or k.shape[0] == 0:
        return _no_keys(q)
    if causal:  # the square case of the protocol: no context, the keys are the chunk's own
        empty = torch.empty(0, dtype=torch.long, device=q.device)
        return prefill_attention(q, k, v, scale, slots=empty, new_k=k, new_v=v)
    if paged:
        return prefill_attention(q, k.pool, v.pool, scale, slots=k.slots)
    return prefill_attention(q, k, v, scale)


def _context_keys(k_pool, v_pool, slots, dtype):
    if not runs_here(k_pool):
        return _GQA.context_keys(k_pool, v_pool, slots, dtype)
    return PagedKeys(k_pool, slots, dtype), PagedKeys(v_pool, slots, dtype)


def _decode_runs(q, k_pool, decode, score_mod) -> bool:
    """The decode kernel takes this batch: own slots per request, no score modifier, a device and dtypes it reads."""
    return (score_mod is None and not decode.shared_keys and decode.lengths is not None and runs_here(k_pool)
            and q.dtype in POOL_DTYPES)


def _attend_decode(q, k_pool, v_pool, decode, scale: float, every_row_sees_a_key: bool = False,
                   score_mod=None):
    # q [B, Hq, D] -> out [B, Hq, D] float32, lse [B, Hq] float32
    if not _decode_runs(q, k_pool, decode, score_mod):
        return _GQA.attend_decode(q, k_pool, v_pool, decode, scale, every_row_sees_a_key, score_mod)
    return paged_decode_attention(q, k_pool, v_pool, decode.slots, decode.lengths, scale)


def _attend_decode_whole(q, k_pool, v_pool, decode, scale: float):
    if not _decode_runs(q, k_pool, decode, None):
        return _GQA.attend_decode_whole(q, k_pool, v_pool, decode, scale)
    out, _ = paged_decode_attention(q, k_pool, v_pool, decode.slots, decode.lengths, scale)
    return out.to(q.dtype)  # the layer's output projection follows directly


def _decode_form(decode, k_pool):
    if decode is None or runs_here(k_pool):
        return decode  # each request's own slots: what the kernel reads
    return local_attention.decode_form(decode, k_pool)


class TritonPagedBackend:
    """Query heads in groups over shared K/V heads, K/V rows of [Hkv, D] in the pools, the Triton kernels reading
    them in place (see the module)."""

    name = "gqa-triton"
    causal_offsets = False
    """Its prefill kernel's causal form is square only: the CP layer attends a run and the keys before it in two
    calls and merges them."""
    row_causal_offsets = False
    """Nor one offset per query row: a PCP rank's head and tail runs take calls of their own."""
    narrow_output = False
    """`attend` writes its own output dtype (no `out_dtype=`)."""
    store_kv = staticmethod(_GQA.store_kv)  # index_copy_: one launch per pool, capturable in a CUDA graph
    attend = staticmethod(_attend)
    context_keys = staticmethod(_context_keys)
    rows_to_move = staticmethod(_GQA.rows_to_move)
    rows_moved = staticmethod(_GQA.rows_moved)
    attend_decode = staticmethod(_attend_decode)
    attend_decode_whole = staticmethod(_attend_decode_whole)
    decode_context = staticmethod(_GQA.decode_context)  # pass-Q: contexts gathered once for several blocks
    attend_gathered_decode = staticmethod(_GQA.attend_gathered_decode)
    decode_form = staticmethod(_decode_form)
    bf16_products = False
    """The Triton kernels compute in the tensors' own dtype: no CPU bf16 variant to switch to."""

    def use_bf16_products(self) -> bool:
        """Never: the CPU kernel's bf16 variant is not this backend's (its kernels follow the tensors' dtype)."""
        return False
