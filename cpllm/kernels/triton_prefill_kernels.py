"""The Triton kernel of prefill attention over the paged pools (its wrapper and contract: triton_prefill.py).

Imports triton at import: only triton_prefill.py imports this module, on first use, where triton is installed.
"""

import triton
import triton.language as tl

from cpllm.kernels.triton_decode_kernels import dot


@triton.jit
def _key_block(q, k, v, keep, m, total, acc, scale, WIDEN: tl.constexpr):
    """One block of keys into the online softmax of a block of queries: q [M, D], k/v [N, D], keep [M, N] bool
    -> the running max m [M], denominator total [M] and numerator acc [M, D] (float32)."""
    scores = tl.where(keep, dot(q, tl.trans(k), WIDEN) * scale, float("-inf"))  # [M, N]
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # a row that has seen no key yet stays at 0 / 0
    alpha = tl.exp(m - m_safe)
    p = tl.exp(scores - m_safe[:, None])
    total = total * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + dot(p.to(q.dtype), v, WIDEN)
    return m_new, total, acc


@triton.jit
def prefill_kernel(q_ptr, ck_ptr, cv_ptr, slots_ptr, nk_ptr, nv_ptr, out_ptr, lse_ptr, scale, num_q, ctx_len,
                   num_new, stride_ql, stride_qh, stride_ckn, stride_ckh, stride_cvn, stride_cvh, stride_nkn,
                   stride_nkh, stride_nvn, stride_nvh, stride_ol, stride_oh, stride_ll,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr, USE_SLOTS: tl.constexpr, WIDEN: tl.constexpr):
    block, head = tl.program_id(0), tl.program_id(1)
    kv_head = head // GROUP
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    m_ok, d_ok = rows < num_q, offs_d < HEAD_DIM
    q = tl.load(q_ptr + rows[:, None] * stride_ql + head * stride_qh + offs_d[None, :],
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    if WIDEN:
        q = q.to(tl.float32)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # The cached context: every query sees every key (read through the slot table, in place, where USE_SLOTS).
    for start in range(0, ctx_len, BLOCK_N):
        pos = start + offs_n
        n_ok = pos < ctx_len
        if USE_SLOTS:
            index = tl.load(slots_ptr + pos, mask=n_ok, other=0).to(tl.int64)
        else:
            index = pos.to(tl.int64)
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(ck_ptr + index[:, None] * stride_ckn + kv_head * stride_ckh + offs_d[None, :], mask=kv_mask,
                    other=0.0).to(q.dtype)
        v = tl.load(cv_ptr + index[:, None] * stride_cvn + kv_head * stride_cvh + offs_d[None, :], mask=kv_mask,
                    other=0.0).to(q.dtype)
        m, total, acc = _key_block(q, k, v, n_ok[None, :] & m_ok[:, None], m, total, acc, scale, WIDEN)
    # The chunk's own new keys, causally: query i sees new keys 0..i (none past this block's last row).
    new_end = tl.minimum(num_new, (block + 1) * BLOCK_M)
    for start in range(0, new_end, BLOCK_N):
        pos = start + offs_n
        n_ok = pos < num_new
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(nk_ptr + pos[:, None] * stride_nkn + kv_head * stride_nkh + offs_d[None, :], mask=kv_mask,
                    other=0.0).to(q.dtype)
        v = tl.load(nv_ptr + pos[:, None] * stride_nvn + kv_head * stride_nvh + offs_d[None, :], mask=kv_mask,
                    other=0.0).to(q.dtype)
        keep = n_ok[None, :] & m_ok[:, None] & (pos[None, :] <= rows[:, None])
        m, total, acc = _key_block(q, k, v, keep, m, total, acc, scale, WIDEN)
    seen = total > 0
    out = tl.where(seen[:, None], acc / tl.where(seen, total, 1.0)[:, None], 0.0)
    lse = tl.where(seen, m + tl.log(tl.where(seen, total, 1.0)), float("-inf"))
    tl.store(out_ptr + rows[:, None] * stride_ol + head * stride_oh + offs_d[None, :], out,
             mask=m_ok[:, None] & d_ok[None, :])
    tl.store(lse_ptr + rows * stride_ll + head, lse, mask=m_ok)
