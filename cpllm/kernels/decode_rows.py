"""Rotary embedding of q and k, the K/V store and silu(gate) * up, each one C call on eager CPU steps
(cpllm/kernels/decode_rows.c).

Each helper returns False where it does not apply (kernels off or not built, another device or dtype, a layout it
does not read, a compiled graph: inductor fuses these ops itself) and the caller runs its torch ops. Inputs whose
sizes disagree raise ValueError; the K/V store checks every slot against the pool and every row against x in C
before its first write, and raises IndexError naming the first bad one (nothing written).
"""

from __future__ import annotations

import torch

from cpllm.kernels.checks import store_rows_error
from cpllm.kernels.decode_attention import POOL_DTYPES
from cpllm.kernels.library import load


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
    lib = load("decode_rows")
    if lib is None:
        return False
    tokens, q_heads, head_dim = q.shape
    k_tokens, k_heads, k_head_dim = k.shape
    if k_tokens != tokens or k_head_dim != head_dim or cos.numel() != tokens * head_dim \
            or sin.numel() != tokens * head_dim:
        raise ValueError(f"rotary kernel: q {tuple(q.shape)}, k {tuple(k.shape)} and tables {tuple(cos.shape)}, "
                         f"{tuple(sin.shape)} do not fit together")
    return lib.cpllm_rope_qk(q.data_ptr(), q_heads, q.stride(0), k.data_ptr(), k_heads, k.stride(0), tokens,
                             head_dim, cos.data_ptr(), sin.data_ptr()) == 0


def widen_rope_qkv(tables: tuple[torch.Tensor, torch.Tensor], qkv: torch.Tensor, q_heads: int, k_heads: int,
                   head_dim: int) -> torch.Tensor | None:
    """qkv [N, (Hq + 2 Hkv) * D] bfloat16 (a bf16 GEMM's q|k|v) -> the same rows in float32 with q's and k's heads
    rotated (`rope_qk_` on the widened rows, the same bits), in one pass; None where the kernel does not apply."""
    cos, sin = tables
    tokens = qkv.shape[0]
    if torch.compiler.is_compiling() or qkv.dtype != torch.bfloat16 or qkv.device.type != "cpu" \
            or not qkv.is_contiguous() or cos.dtype != torch.float32 \
            or not (cos.is_contiguous() and sin.is_contiguous()):
        return None
    if qkv.shape[1] != (q_heads + 2 * k_heads) * head_dim or cos.numel() != tokens * head_dim \
            or sin.numel() != tokens * head_dim:
        raise ValueError(f"rotary kernel: q|k|v {tuple(qkv.shape)} for {q_heads} + 2 x {k_heads} heads of {head_dim} "
                         f"and tables {tuple(cos.shape)}, {tuple(sin.shape)} do not fit together")
    lib = load("decode_rows")
    if lib is None:
        return None
    out = torch.empty(qkv.shape, dtype=torch.float32)
    status = lib.cpllm_widen_rope_qkv(qkv.data_ptr(), q_heads, k_heads, k_heads, tokens, head_dim, cos.data_ptr(),
                                      sin.data_ptr(), out.data_ptr(), torch.get_num_threads())
    return out if status == 0 else None


def store_rows_(pool: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, rows: torch.Tensor) -> bool:
    """pool[slots[i]] = x[rows[i]] in the pool's dtype, for x [N, H, D] float32 and a contiguous pool
    [num_slots, H, D]; False where the kernel does not apply (nothing was written). A slot outside the pool or a
    row outside x raises IndexError (nothing written)."""
    if torch.compiler.is_compiling() or not _heads_rows(x) or pool.dtype not in POOL_DTYPES:
        return False
    if not pool.is_contiguous() or pool.shape[1:] != x.shape[1:] or slots.dtype != torch.long \
            or rows.dtype != torch.long or not (slots.is_contiguous() and rows.is_contiguous()):
        return False
    lib = load("decode_rows")
    if lib is None:
        return False
    writes = slots.numel()
    if rows.numel() != writes:
        raise ValueError(f"K/V store: slots {tuple(slots.shape)} and rows {tuple(rows.shape)} are not one of each")
    num_slots, num_rows = pool.shape[0], x.shape[0]
    status = lib.cpllm_store_rows(x.data_ptr(), x.stride(0), num_rows, rows.data_ptr(), slots.data_ptr(), writes,
                                  x.shape[1] * x.shape[2], pool.data_ptr(), num_slots, POOL_DTYPES[pool.dtype])
    if status != 0:
        raise store_rows_error(status, slots, rows, num_slots, num_rows)
    return True


def silu_mul(gate_up: torch.Tensor, inter: int, out_dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """silu(gate) * up for gate_up [N, 2 * inter] (gate | up) in float32 (out_dtype None or float32), or, asked for
    by `out_dtype`, in bfloat16 (a bf16 GEMM's output, widened exactly), computed in float32 and returned in
    `out_dtype` (float32, or bfloat16 rounded as torch rounds); None where the kernel does not apply (a bf16 model's
    own rows, out_dtype None: its torch ops round as the model does)."""
    if (torch.compiler.is_compiling() or gate_up.device.type != "cpu" or gate_up.dim() != 2
            or gate_up.shape[1] != 2 * inter or not gate_up.is_contiguous()):
        return None
    out_dtype = torch.float32 if out_dtype is None and gate_up.dtype == torch.float32 else out_dtype
    narrow = gate_up.dtype == torch.bfloat16
    if not (gate_up.dtype == torch.float32 and out_dtype == torch.float32
            or narrow and out_dtype in (torch.float32, torch.bfloat16)):
        return None
    lib = load("decode_rows")
    if lib is None:
        return None
    out = torch.empty(gate_up.shape[0], inter, dtype=out_dtype)
    if narrow:
        lib.cpllm_silu_mul_bf16(gate_up.data_ptr(), gate_up.shape[0], inter, out.data_ptr(),
                                int(out_dtype == torch.bfloat16), torch.get_num_threads())
    else:
        lib.cpllm_silu_mul(gate_up.data_ptr(), gate_up.shape[0], inter, out.data_ptr(), torch.get_num_threads())
    return out
