"""Which kernel runs the int4 layers on this CPU: read from the CPU's reported features, confirmed by a short
measurement at start-up, logged once per process.

- AVX-512 VNNI (and the VNNI kernel built): "vnni", cpllm/kernels/int4_matmul.c, for every row count.
- else AVX2 + FMA + F16C (and the AVX2 kernel built): "avx2", cpllm/kernels/int4_avx2.c. Few rows (decode) run
  its integer dot products; from `gemm_from_rows` rows on (prefill) the weight is dequantized tile by tile for
  float32 GEMMs. The threshold is measured at start-up: both ways on one SmolLM2-sized layer at a few row counts,
  the threshold that minimizes the time per row summed over the probed counts.
- else aten's int4 kernel ("aten", bfloat16 activations).
The features come from /proc/cpuinfo (`cpu_features`, which tests replace); a kernel also reports whether it was
compiled for them (`-march=native`), and both must agree. `CPLLM_KERNELS=0` gives "aten".
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from cpllm.kernels import int4_avx2, int4_matmul

logger = logging.getLogger(__name__)

PROBE_SHAPE = (1536, 576)
"""(out, in) of the layer the start-up measurement multiplies (SmolLM2's widest input count to its MLP)."""
PROBE_ROWS = (32, 64, 128, 256, 512)
"""Row counts at which both AVX2 ways are timed."""
NEVER = 1 << 62
"""`gemm_from_rows` when the GEMMs won at no measured row count."""


@dataclass(kw_only=True, frozen=True, slots=True)
class CpuFeatures:
    """The instruction-set features the int4 kernels need, as the CPU reports them."""

    avx2: bool
    """256-bit integer vectors (vpmaddubsw)."""
    fma: bool
    """Fused multiply-add."""
    f16c: bool
    """float16 <-> float32 conversion (the stored d and m)."""
    avx512_vnni: bool
    """vpdpbusd on 512-bit vectors (the VNNI kernel)."""
    avx512_bf16: bool
    """bfloat16 dot products (reported, no kernel of this module uses them yet)."""
    amx: bool
    """AMX tiles, bf16 or int8 (reported, no kernel of this module uses them yet)."""

    @classmethod
    def from_flags(cls, flags: set[str]) -> "CpuFeatures":
        return cls(avx2="avx2" in flags, fma="fma" in flags, f16c="f16c" in flags,
                   avx512_vnni="avx512_vnni" in flags and "avx512bw" in flags, avx512_bf16="avx512_bf16" in flags,
                   amx=bool({"amx_bf16", "amx_int8"} & flags))


def cpu_features() -> CpuFeatures:
    """This CPU's features from /proc/cpuinfo (none where it cannot be read)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
    return CpuFeatures.from_flags(set(flags))


@dataclass(kw_only=True, frozen=True, slots=True)
class Int4Choice:
    """The int4 kernel this process runs, and what the start-up measurement found."""

    backend: str
    """"vnni", "avx2" or "aten" (see the module)."""
    gemm_from_rows: int
    """avx2: rows from which a call dequantizes for float32 GEMMs (`NEVER`: it never does); else 0, unused."""
    decode_gbps: float
    """avx2: int4 weight bytes per second of the integer kernel at 1 row, 1 thread (0 where not measured)."""
    gemm_gflops: float
    """avx2: useful GFLOP/s on 1 thread of the dequantize-and-GEMM way at the largest probed row count (0 where not measured)."""
    reason: str
    """Why this kernel: the features found, or what was missing."""


def choose(features: CpuFeatures | None = None) -> Int4Choice:
    """The kernel for this CPU (`features`: what it reports, read from /proc/cpuinfo by default)."""
    features = cpu_features() if features is None else features
    if features.avx512_vnni and int4_matmul.available():
        return Int4Choice(backend="vnni", gemm_from_rows=0, decode_gbps=0.0, gemm_gflops=0.0,
                          reason="AVX-512 VNNI")
    missing = [name for name in ("avx2", "fma", "f16c") if not getattr(features, name)]
    if not missing and int4_avx2.available():
        return avx2_choice()
    why = f"no {', '.join(missing)}" if missing else "AVX2 kernel not built or kernels off"
    return Int4Choice(backend="aten", gemm_from_rows=0, decode_gbps=0.0, gemm_gflops=0.0,
                      reason=f"no AVX-512 VNNI; {why}")


@functools.cache
def avx2_choice() -> Int4Choice:
    """The avx2 kernel with its measured threshold, measured once per process on one thread (both ways split
    their work over threads alike, so the threshold holds at any count, and one thread on a shared machine is the
    least disturbed by other load), and logged."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _measured()
    finally:
        torch.set_num_threads(saved)


def _measured() -> Int4Choice:
    out_features, in_features = PROBE_SHAPE
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, PROBE_SHAPE, dtype=torch.uint8, generator=gen)
    d = torch.rand(out_features, in_features // 32, generator=gen) * 0.01
    packed = int4_matmul.pack(codes, d, -8 * d)
    x = torch.randn(max(PROBE_ROWS), in_features, generator=gen)
    int_one = _best_seconds([lambda: int4_avx2.matmul(x[:1], packed, out_features)])[0]
    per_row = []  # (integer, gemm) seconds per row at each probed count
    for rows in PROBE_ROWS:
        times = _best_seconds([lambda: int4_avx2.matmul(x[:rows], packed, out_features),
                               lambda: int4_avx2.dequantized_matmul(x[:rows], packed, out_features)])
        per_row.append((times[0] / rows, times[1] / rows))
    gemm_seconds = per_row[-1][1] * max(PROBE_ROWS)
    # the threshold with the least time per row summed over the probes: one noisy probe cannot move it far
    costs = {limit: sum(gemm if rows >= limit else integer for rows, (integer, gemm) in zip(PROBE_ROWS, per_row))
             for limit in (*PROBE_ROWS, NEVER)}
    gemm_from_rows = min(costs, key=costs.get)
    choice = Int4Choice(backend="avx2", gemm_from_rows=gemm_from_rows, decode_gbps=round(packed.numel() / int_one / 1e9, 2),
                        gemm_gflops=round(2 * max(PROBE_ROWS) * out_features * in_features / gemm_seconds / 1e9, 1),
                        reason="AVX2 + FMA + F16C, no AVX-512 VNNI")
    logger.info("int4 kernel: avx2 (%s); measured on 1 thread: decode by int8 dot products at %.2f GB/s of "
                "weights, dequantized float32 GEMMs from %s rows (%.1f GFLOP/s at %d rows)", choice.reason,
                choice.decode_gbps, "no" if gemm_from_rows == NEVER else gemm_from_rows, choice.gemm_gflops,
                max(PROBE_ROWS))
    return choice


def _best_seconds(calls: list, rounds: int = 3) -> list[float]:
    """Each call's fastest of `rounds`, the calls alternating within each round (other load only adds time)."""
    best = [float("inf")] * len(calls)
    for call in calls:
        call()  # warm-up: page faults, thread pool
    for _ in range(rounds):
        for i, call in enumerate(calls):
            start = time.perf_counter()
            call()
            best[i] = min(best[i], time.perf_counter() - start)
    return best
