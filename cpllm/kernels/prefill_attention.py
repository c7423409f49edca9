"""Prefill attention with its log-sum-exp in one C call (cpllm/kernels/prefill_attention.c).

Many query positions against a run of keys, causal (top-left aligned, as the flash kernel's flag, or after
`causal_offset` earlier keys that every query sees: bottom-right for a query run behind its context) or not, float32
on the CPU, every KV head read once for the query heads that share it. Measured 1.3-1.7x the throughput of
PyTorch's CPU flash-attention kernel on one thread (docs/benchmarks.md). With `bf16_products`, both products run
on bf16 (q, K, V and the probabilities rounded to bfloat16; scores, softmax, output and log-sum-exp in float32: the
approximate formats' path, never the exact float32 one), in one of two ways: "amx" on AMX tiles (Intel, head sizes
that are multiples of 32) or "avx512_bf16" on vdpbf16ps. Which one, if either, this process runs is chosen once
(`bf16_choice`): by what the kernel was built for and the OS allows, confirmed by a short measurement against the
float32 kernel, and logged. Without a way that pays, or for a head size the way does not take, the float32 kernel
runs. Where it cannot run (kernels off, no compiler or no AVX-512, another device or dtype, a head size it does
not take) `prefill_attention` returns None and the caller runs PyTorch's kernel. Keys and values of other shapes
than each other, or another head size than the queries', raise ValueError.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass

import torch

from cpllm.kernels.library import load

logger = logging.getLogger(__name__)

MAX_HEAD_DIM = 256
"""Widest head the kernel's per-thread tile holds (its head size must also be a multiple of 4)."""


ENTRIES = {"amx": "cpllm_prefill_attention_amx", "avx512_bf16": "cpllm_prefill_attention_bf16",
           "float32": "cpllm_prefill_attention"}
"""The C entry point of each way, the bf16 ones in order of preference."""
BF16_WAYS = ("amx", "avx512_bf16")
"""The ways with bf16 products, preferred first."""
PROBE = (512, 9, 3, 64)
"""(positions, query heads, KV heads, head size) of the start-up measurement: a causal SmolLM2-shaped call."""
MIN_GAIN = 1.15
"""A bf16 way is taken only at this multiple of the float32 kernel's measured rate or more: rounding to bf16
must buy speed (on a Sapphire Rapids core vdpbf16ps ran at 0.7x float32, AMX tiles at 3.0x, SmolLM2 at 2K)."""


@dataclass(kw_only=True, frozen=True, slots=True)
class Bf16Choice:
    """The bf16 way this process's prefill attention runs, and what the start-up measurement found."""

    way: str
    """"amx", "avx512_bf16", or "" (bf16 products do not pay here: `bf16_products` runs the float32 kernel)."""
    gflops: dict[str, float]
    """Useful GFLOP/s on 1 thread of each measured way ("float32" included) on the PROBE call."""


def _call(lib, way: str, q, k, v, scale: float, causal_offset: int, threads: int, out, lse,
          row_offsets: torch.Tensor | None = None) -> int:
    return getattr(lib, ENTRIES[way])(q.data_ptr(), q.stride(0), k.data_ptr(), v.data_ptr(), k.stride(0),
                                      q.shape[0], k.shape[0], q.shape[1], k.shape[1], q.shape[2], scale,
                                      causal_offset, None if row_offsets is None else row_offsets.data_ptr(),
                                      threads, out.data_ptr(), lse.data_ptr(), int(out.dtype == torch.bfloat16))


def built_ways() -> tuple[str, ...]:
    """The bf16 ways the kernel runs on this machine (built for it, allowed by the OS), preferred first."""
    lib = load("prefill_attention")
    if lib is None:
        return ()
    q = torch.ones(1, 1, 64)
    out, lse = torch.empty(1, 1, 64), torch.empty(1, 1)
    return tuple(way for way in BF16_WAYS if _call(lib, way, q, q, q, 1.0, 0, 1, out, lse) != 2)


def pick_way(gflops: dict[str, float]) -> str:
    """The first bf16 way measured at MIN_GAIN x float32's rate or more, else ""."""
    return next((way for way in BF16_WAYS if gflops.get(way, 0.0) >= MIN_GAIN * gflops["float32"]), "")


def _measure(lib, way: str) -> float:
    """Useful GFLOP/s of `way` on the PROBE call, 1 thread, fastest of 3."""
    positions, hq, hkv, d = PROBE
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(positions, hq, d, generator=generator)
    k, v = (torch.randn(positions, hkv, d, generator=generator) for _ in range(2))
    out, lse = torch.empty(positions, hq, d), torch.empty(positions, hq)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        _call(lib, way, q, k, v, d**-0.5, 0, 1, out, lse)
        best = min(best, time.perf_counter() - start)
    return 2 * positions * positions * hq * d / best / 1e9  # causal: half of 4 L^2 Hq D


@functools.cache
def bf16_choice() -> Bf16Choice:
    """The bf16 way of this process (measured once, logged)."""
    ways = built_ways()
    if not ways:
        return Bf16Choice(way="", gflops={})
    lib = load("prefill_attention")
    gflops = {way: round(_measure(lib, way), 1) for way in ("float32", *ways)}
    choice = Bf16Choice(way=pick_way(gflops), gflops=gflops)
    logger.info("prefill attention with bf16 products: %s (measured GFLOP/s on 1 thread: %s)",
                choice.way or "float32, no bf16 way pays here", gflops)
    return choice


def has_bf16_products() -> bool:
    """This process's prefill attention has a bf16 way that pays (`bf16_products=True` runs it)."""
    return bf16_choice().way != ""


def _row_offsets(offsets: torch.Tensor, length: int, keys: int) -> torch.Tensor:
    """Per-query causal offsets as the kernel reads them (int32, contiguous), each query's last key checked."""
    if offsets.shape != (length,) or offsets.dtype.is_floating_point:
        raise ValueError(f"prefill attention: causal_offset of shape {tuple(offsets.shape)} and dtype "
                         f"{offsets.dtype}; wants one integer per query ({length})")
    last = offsets + torch.arange(length, dtype=offsets.dtype)
    if int(last.min()) < 0 or int(last.max()) >= keys:
        raise ValueError(f"prefill attention: per-query causal offsets reach keys [{int(last.min())}, "
                         f"{int(last.max())}] outside [0, {keys})")
    return offsets.to(torch.int32).contiguous()


def _rows_in_place(x: torch.Tensor) -> bool:
    """[N, H, D] with each row's [H, D] contiguous (rows may sit at any stride, as q inside the fused qkv)."""
    return x.stride(2) == 1 and x.stride(1) == x.shape[2] and x.stride(0) >= x.shape[1] * x.shape[2]


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
                      bf16_products: bool = False, causal_offset: int | torch.Tensor = 0,
                      bf16_way: str | None = None,
                      out_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor] | None:
    """out [L, Hq, D] in `out_dtype` and lse [L, Hq] float32, or None where the kernel does not apply. out_dtype
    float32, or bfloat16: the float32 output rounded as torch rounds it, written so (for a consumer that rounds it
    anyway, as a bf16 GEMM's input: no float32 copy to write and read back).

    q [L, Hq, D], k and v [S, Hkv, D], L and S > 0; causal: query i sees keys j <= i + causal_offset (0 <=
    i + causal_offset <= S - 1), the offset one int or one per query (an int tensor [L]: runs of queries at other
    places of one key order, in one call); bf16_products: on bf16 products, in `bf16_way` ("amx" or "avx512_bf16";
    None: this process's `bf16_choice`) where it runs, else float32 (see the module)."""
    length, hq, d = q.shape
    keys, hkv = k.shape[0], k.shape[1]
    if not (q.device.type == k.device.type == v.device.type == "cpu"
            and q.dtype == k.dtype == v.dtype == torch.float32
            and d % 4 == 0 and d <= MAX_HEAD_DIM and hq % hkv == 0 and length > 0 and keys > 0):
        return None
    lib = load("prefill_attention")
    if lib is None:
        return None
    row_offsets = None
    if isinstance(causal_offset, torch.Tensor):
        row_offsets, causal_offset = _row_offsets(causal_offset, length, keys), 0
    elif causal and not 0 <= causal_offset < keys:
        raise ValueError(f"prefill attention: causal_offset {causal_offset} outside [0, {keys}) for {keys} keys")
    if v.shape != k.shape or k.shape[2] != d:
        raise ValueError(f"prefill attention: q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} do not "
                         f"fit together")
    if not _rows_in_place(q):
        q = q.contiguous()
    if not (_rows_in_place(k) and _rows_in_place(v) and k.stride(0) == v.stride(0)):
        k, v = k.contiguous(), v.contiguous()
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"prefill attention: out_dtype {out_dtype}; float32 or bfloat16")
    out = torch.empty(length, hq, d, dtype=out_dtype)
    lse = torch.empty(length, hq, dtype=torch.float32)
    way = (bf16_choice().way if bf16_way is None else bf16_way) if bf16_products else ""
    if way and way not in BF16_WAYS:
        raise ValueError(f"prefill attention: bf16_way {way!r}; one of {BF16_WAYS}")
    args = (q, k, v, scale, causal_offset if causal else -1, torch.get_num_threads(), out, lse,
            row_offsets if causal else None)
    with torch.profiler.record_function("cpllm::prefill_flash_attention"):  # named in profiles as an op would be
        status = _call(lib, way, *args) if way else 2
        if status == 2:  # float32 asked for, or that way does not run here (or not for this head size)
            status = _call(lib, "float32", *args)
    if status == 2:
        return None  # built without AVX-512
    if status != 0:
        raise MemoryError(f"prefill attention kernel failed (status {status}) on q {tuple(q.shape)}, "
                          f"k {tuple(k.shape)}")
    return out, lse
