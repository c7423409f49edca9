"""The Triton kernels of decode attention over the paged pools (their wrappers and contract: triton_attention.py).

Imports triton at import: only triton_attention.py imports this module, on first use, where triton is installed.
"""

import triton
import triton.language as tl


@triton.jit
def dot(a, b, WIDEN: tl.constexpr):
    """a @ b accumulated in float32: in float32 (IEEE) where WIDEN, else in a's dtype (tensor cores)."""
    if WIDEN:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def decode_split_kernel(q_ptr, k_ptr, v_ptr, slots_ptr, lengths_ptr, out_ptr, lse_ptr, scale, split_len,
                        stride_qb, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_sb,
                        stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
                        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr,
                        BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, WIDEN: tl.constexpr):
    b, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    g_ok, d_ok = offs_g < GROUP, offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g  # query heads h // GROUP == kv_head, as the CPU kernels map them
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]
    if WIDEN:
        q = q.to(tl.float32)
    length = tl.load(lengths_ptr + b)
    begin = split * split_len
    end = tl.minimum(begin + split_len, length)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start in range(begin, end, BLOCK_N):
        pos = start + offs_n
        n_ok = pos < end
        slot = tl.load(slots_ptr + b * stride_sb + pos, mask=n_ok, other=0).to(tl.int64)  # [BLOCK_N], in place
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + slot[:, None] * stride_kn + kv_head * stride_kh + offs_d[None, :], mask=kv_mask,
                    other=0.0).to(q.dtype)  # [BLOCK_N, BLOCK_D]
        scores = dot(q, tl.trans(k), WIDEN)
        scores = tl.where(n_ok[None, :], scores * scale, float("-inf"))  # [BLOCK_G, BLOCK_N] float32
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        total = total * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + slot[:, None] * stride_vn + kv_head * stride_vh + offs_d[None, :], mask=kv_mask,
                    other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + dot(p.to(q.dtype), v, WIDEN)
        m = m_new
    seen = total > 0  # an empty split (past the request's length) leaves (0, -inf)
    out = tl.where(seen[:, None], acc / tl.where(seen, total, 1.0)[:, None], 0.0)
    lse = tl.where(seen, m + tl.log(tl.where(seen, total, 1.0)), float("-inf"))
    tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :], out,
             mask=g_ok[:, None] & d_ok[None, :])
    tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=g_ok)

@triton.jit
def merge_splits_kernel(part_ptr, part_lse_ptr, out_ptr, lse_ptr, splits, stride_pb, stride_ph, stride_ps,
                        stride_plb, stride_plh, stride_ob, stride_oh, stride_lb, stride_lh,
                        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    b, head = tl.program_id(0), tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok, d_ok = offs_s < splits, offs_d < HEAD_DIM
    lse = tl.load(part_lse_ptr + b * stride_plb + head * stride_plh + offs_s, mask=s_ok,
                  other=float("-inf"))  # [BLOCK_S]
    m = tl.max(lse, axis=0)
    any_key = m > float("-inf")
    weight = tl.where(lse > float("-inf"), tl.exp(lse - tl.where(any_key, m, 0.0)), 0.0)
    total = tl.sum(weight, axis=0)
    part = tl.load(part_ptr + b * stride_pb + head * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
                   mask=s_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_S, BLOCK_D]
    out = tl.sum(part * weight[:, None], axis=0) / tl.where(any_key, total, 1.0)
    tl.store(out_ptr + b * stride_ob + head * stride_oh + offs_d, out, mask=d_ok)
    tl.store(lse_ptr + b * stride_lb + head * stride_lh,
             tl.where(any_key, m + tl.log(tl.where(any_key, total, 1.0)), float("-inf")))
