"""Prefill attention with its log-sum-exp in one C call (cpllm/kernels/prefill_attention.c).

Many query positions against a run of keys, causal (top-left aligned, as the flash kernel's flag, or after
`causal_offset` earlier keys that every query sees: bottom-right for a query run behind its context) or not, float32
on the CPU, every KV head read once for the query heads that share it. Measured 1.3-1.7x the throughput of
PyTorch's CPU flash-attention kernel on one thread (docs/benchmarks.md). With `bf16_products` and a CPU with
AVX-512 BF16, both products run on bf16 dot products (q, K, V and the probabilities rounded to bfloat16, scores,
softmax, output and log-sum-exp in float32: the approximate formats' path, never the exact float32 one); without
those instructions the float32 kernel runs. Where it cannot run (kernels off, no
compiler or no AVX-512, another device or dtype, a head size it does not take) `prefill_attention` returns None
and the caller runs PyTorch's kernel. Keys and values of other shapes than each other, or another head size than
the queries', raise ValueError.
"""

from __future__ import annotations

import torch

from cpllm.kernels.library import load

MAX_HEAD_DIM = 256
"""Widest head the kernel's per-thread tile holds (its head size must also be a multiple of 4)."""


def has_bf16_products() -> bool:
    """The kernel is built with AVX-512 BF16 here: `bf16_products=True` runs on them (else on float32)."""
    lib = load("prefill_attention")
    if lib is None:
        return False
    one = torch.ones(1, 1, 4)
    out, lse = torch.empty(1, 1, 4), torch.empty(1, 1)
    return lib.cpllm_prefill_attention_bf16(one.data_ptr(), 4, one.data_ptr(), one.data_ptr(), 4, 1, 1, 1, 1, 4, 1.0,
                                            0, 1, out.data_ptr(), lse.data_ptr()) != 2


def _rows_in_place(x: torch.Tensor) -> bool:
    """[N, H, D] with each row's [H, D] contiguous (rows may sit at any stride, as q inside the fused qkv)."""
    return x.stride(2) == 1 and x.stride(1) == x.shape[2] and x.stride(0) >= x.shape[1] * x.shape[2]


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
                      bf16_products: bool = False,
                      causal_offset: int = 0) -> tuple[torch.Tensor, torch.Tensor] | None:
    """out [L, Hq, D] float32 and lse [L, Hq] float32, or None where the kernel does not apply.

    q [L, Hq, D], k and v [S, Hkv, D], L and S > 0; causal: query i sees keys j <= i + causal_offset (0 <=
    causal_offset <= S - 1); bf16_products: on bf16 dot products where the CPU has them (see the module)."""
    length, hq, d = q.shape
    keys, hkv = k.shape[0], k.shape[1]
    if not (q.device.type == k.device.type == v.device.type == "cpu"
            and q.dtype == k.dtype == v.dtype == torch.float32
            and d % 4 == 0 and d <= MAX_HEAD_DIM and hq % hkv == 0 and length > 0 and keys > 0):
        return None
    lib = load("prefill_attention")
    if lib is None:
        return None
    if causal and not 0 <= causal_offset < keys:
        raise ValueError(f"prefill attention: causal_offset {causal_offset} outside [0, {keys}) for {keys} keys")
    if v.shape != k.shape or k.shape[2] != d:
        raise ValueError(f"prefill attention: q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} do not "
                         f"fit together")
    if not _rows_in_place(q):
        q = q.contiguous()
    if not (_rows_in_place(k) and _rows_in_place(v) and k.stride(0) == v.stride(0)):
        k, v = k.contiguous(), v.contiguous()
    out = torch.empty(length, hq, d, dtype=torch.float32)
    lse = torch.empty(length, hq, dtype=torch.float32)
    args = (q.data_ptr(), q.stride(0), k.data_ptr(), v.data_ptr(), k.stride(0), length, keys, hq, hkv, d, scale,
            causal_offset if causal else -1, torch.get_num_threads(), out.data_ptr(), lse.data_ptr())
    with torch.profiler.record_function("cpllm::prefill_flash_attention"):  # named in profiles as an op would be
        status = lib.cpllm_prefill_attention_bf16(*args) if bf16_products else 2
        if status == 2:  # float32 asked for, or no bf16 dot products here
            status = lib.cpllm_prefill_attention(*args)
    if status == 2:
        return None  # built without AVX-512
    if status != 0:
        raise MemoryError(f"prefill attention kernel failed (status {status}) on q {tuple(q.shape)}, "
                          f"k {tuple(k.shape)}")
    return out, lse
