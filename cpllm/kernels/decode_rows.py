"""Rotary embedding of q and k, the K/V store and silu(gate) * up, each one C call on eager CPU steps
(cpllm/kernels/decode_rows.c).

Each helper returns False where it does not apply (kernels off or not built, another device or dtype, a layout it
does not read, a compiled graph: inductor fuses these ops itself) and the caller runs its torch ops.
"""

from __future__ import annotations

import ctypes

import torch

from cpllm.kernels.build import load_typed
from cpllm.kernels.decode_attention import POOL_DTYPES

_lib: ctypes.CDLL | None = None
"""The loaded library, kept once found (a lookup per call would cost a fifth of the call)."""


def _library() -> ctypes.CDLL | None:
    global _lib
    if _lib is None:
        p, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
        _lib = load_typed("decode_rows", {"cpllm_rope_qk": ([p, i, i64, p, i, i64, i64, i, p, p], i),
                                          "cpllm_store_rows": ([p, i64, p, p, i64, i64, p, i], None),
                                          "cpllm_silu_mul": ([p, i64, i64, p, i], None)})
    return _lib


def _heads_rows(x: torch.Tensor) -> bool:
    """x [N, H, D] float32 on CPU with each token's heads contiguous (a view into a wider row is fine)."""
    return (x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 3 and x.stride(2) == 1
            and x.stride(1) == x.shape[2])


def rope_qk_(tables: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor, k: torch.Tensor) -> bool:
    """Rotate q [N, Hq, D] and k [N, Hkv, D] in place with the step's tables (RotaryEmbedding.tables); False
    where the kernel does not apply (nothing was changed)."""
    cos, sin = tables
    if torch.compiler.is_compiling() or not (_heads_rows(q) and _heads_rows(k)):
        return False
    if cos.dtype != torch.float32 or not (cos.is_contiguous() and sin.is_contiguous()) or q.shape[0] != cos.shape[0]:
        return False
    lib = _library()
    if lib is None:
        return False
    return lib.cpllm_rope_qk(q.data_ptr(), q.shape[1], q.stride(0), k.data_ptr(), k.shape[1], k.stride(0),
                             q.shape[0], q.shape[2], cos.data_ptr(), sin.data_ptr()) == 0


def store_rows_(pool: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, rows: torch.Tensor) -> bool:
    """pool[slots[i]] = x[rows[i]] in the pool's dtype, for x [N, H, D] float32 and a contiguous pool
    [num_slots, H, D]; False where the kernel does not apply (nothing was written)."""
    if torch.compiler.is_compiling() or not _heads_rows(x) or pool.dtype not in POOL_DTYPES:
        return False
    if not pool.is_contiguous() or pool.shape[1:] != x.shape[1:] or slots.dtype != torch.long \
            or rows.dtype != torch.long or not (slots.is_contiguous() and rows.is_contiguous()):
        return False
    lib = _library()
    if lib is None:
        return False
    lib.cpllm_store_rows(x.data_ptr(), x.stride(0), rows.data_ptr(), slots.data_ptr(), slots.shape[0],
                         x.shape[1] * x.shape[2], pool.data_ptr(), POOL_DTYPES[pool.dtype])
    return True


def silu_mul(gate_up: torch.Tensor, inter: int) -> torch.Tensor | None:
    """silu(gate) * up for gate_up [N, 2 * inter] float32 (gate | up), or None where the kernel does not apply."""
    if (torch.compiler.is_compiling() or gate_up.dtype != torch.float32 or gate_up.device.type != "cpu"
            or gate_up.dim() != 2 or gate_up.shape[1] != 2 * inter or not gate_up.is_contiguous()):
        return None
    lib = _library()
    if lib is None:
        return None
    out = torch.empty(gate_up.shape[0], inter, dtype=torch.float32)
    lib.cpllm_silu_mul(gate_up.data_ptr(), gate_up.shape[0], inter, out.data_ptr(), torch.get_num_threads())
    return out
