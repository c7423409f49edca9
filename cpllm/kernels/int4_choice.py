"""Which kernel runs the int4 layers on this CPU: read from the CPU's reported features, confirmed by a short
measurement at start-up, logged once per process.

- The integer kernel, for few rows (decode): AVX-512 VNNI (and that kernel built): "vnni",
  cpllm/kernels/int4_matmul.c; else AVX2 + FMA + F16C (and that kernel built): "avx2", cpllm/kernels/int4_avx2.c;
  else aten's int4 kernel ("aten", bfloat16 activations, no threshold).
- The GEMMs, for many rows (prefill): from `gemm_from_rows` rows on, the weight is dequantized tile by tile for
  torch's GEMMs (int4_gemm.py), in bfloat16 where the CPU reports bf16 dot products (AVX-512 BF16) or AMX tiles,
  which oneDNN runs, else in float32. Below `records_below` rows the bf16 way runs on a kernel fed straight from the
  int4 records instead (int4_records.py: AMX tiles where the CPU has them, else AVX-512 BF16 dot products): no whole
  dequantized weight, no oneDNN reorder.
  The start-up measurement times the integer kernel and each candidate GEMM dtype on one SmolLM2-sized layer at a
  few row counts; the dtype fastest at the largest count is taken, and the threshold that minimizes the time per
  row summed over the probed counts (`NEVER` where the GEMMs never win), or the one `CPLLM_INT4_GEMM_FROM_ROWS`
  sets (cpllm/config/int4_threshold.py).
- `records_below` is the bound, among RECORD_PROBE_ROWS and one past the largest, that minimizes the two bf16 ways'
  time per row summed over those counts, the weights taken in turn as a prefill's layers are (on a Sapphire Rapids
  core: 2,048; on a Zen 4 core: 2,049, the dot products through 2,048 rows).
The features come from /proc/cpuinfo (`cpu_features`, which tests replace); a kernel also reports whether it was
compiled for them (`-march=native`), and both must agree. `CPLLM_KERNELS=0` gives "aten".
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from cpllm.config.int4_threshold import NEVER, THRESHOLD_ENV, threshold_override
from cpllm.kernels import int4_avx2, int4_gemm, int4_matmul, int4_records

logger = logging.getLogger(__name__)

PROBE_SHAPE = (1536, 576)
"""(out, in) of the layer the start-up measurement multiplies (SmolLM2's widest input count to its MLP)."""
PROBE_ROWS = (32, 64, 128, 256, 512)
"""Row counts at which both AVX2 ways are timed."""
RECORD_PROBE_ROWS = (64, 128, 256, 512, 1024, 2048)
"""Row counts at which the record-fed kernel and the bf16 dequantize-and-GEMM way are timed against each other (from
the bf16 GEMMs' floor, BF16_MIN_ROWS)."""
RECORD_BOUNDS = (*RECORD_PROBE_ROWS, max(RECORD_PROBE_ROWS) + 1)
"""The bounds `_records_below` may take: each probed row count, and one past the largest (the record-fed kernels
run through it)."""
COLD_WEIGHTS = 2
"""Weights that probe multiplies in turn, as a prefill's layers follow each other (one weight called again and again
measured the tiles ahead of oneDNN at 2,048 rows, where in SmolLM2's layers they took 1.02-1.13x its time; two
in turn, about 0.25 s of start-up, put the bound at 2,048 on every start, as four did in twice the time)."""
BF16_MIN_ROWS = 64
"""The lowest threshold bf16 GEMMs may take: below it a batch of decodes keeps the integer kernel's rounding
whatever a noisy measurement says (the float32 GEMMs round as little as the integer kernel, and may start lower).
Short prompts above it take the GEMMs where the probe says they pay: on an AMX core a 128-token prompt then
prefilled in 0.54x the time it took on the integer kernel. The ranks of one engine then take the highest threshold any of them measured
(cpllm/worker/int4_agreement.py)."""


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
    """bfloat16 dot products (vdpbf16ps): the prefill GEMMs may run in bfloat16."""
    amx: bool
    """AMX tiles, bf16 or int8: the prefill GEMMs may run in bfloat16 (oneDNN's AMX path)."""

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
    """The int4 kernels this process runs, and what the start-up measurement found."""

    backend: str
    """The integer kernel: "vnni", "avx2" or "aten" (see the module)."""
    gemm_from_rows: int
    """Rows from which a call dequantizes for GEMMs (`NEVER`: it never does; aten: unused)."""
    gemm_dtype: str
    """"bfloat16" or "float32": the GEMMs' dtype ("" for aten)."""
    decode_gbps: float
    """int4 weight bytes per second of the integer kernel at 1 row, 1 thread (0 where not measured)."""
    gemm_gflops: dict[str, float]
    """Useful GFLOP/s on 1 thread of the dequantize-and-GEMM way in each measured dtype, at the largest probed row
    count (empty where not measured)."""
    records_below: int = 0
    """Rows below which the bfloat16 way runs on the kernel fed from the int4 records (int4_records.py: AMX tiles
    or AVX-512 BF16 dot products), one of RECORD_BOUNDS; 0 where it never does (neither kernel runs here, float32
    GEMMs, or slower at every probed count)."""
    reason: str
    """Why these kernels: the features found, or what was missing."""


def gemm_dtypes(features: CpuFeatures) -> tuple[str, ...]:
    """The GEMM dtypes worth measuring on this CPU: bfloat16 only where it reports bf16 dot products or tiles."""
    return ("float32", "bfloat16") if features.avx512_bf16 or features.amx else ("float32",)


def choose(features: CpuFeatures | None = None) -> Int4Choice:
    """The kernels for this CPU (`features`: what it reports, read from /proc/cpuinfo by default)."""
    features = cpu_features() if features is None else features
    dtypes = gemm_dtypes(features) if int4_avx2.available() else ()  # the dequantizer lives in the AVX2 library
    if features.avx512_vnni and int4_matmul.available():
        return measured_choice("vnni", dtypes, "AVX-512 VNNI" + _bf16_note(features))
    missing = [name for name in ("avx2", "fma", "f16c") if not getattr(features, name)]
    if not missing and int4_avx2.available():
        return measured_choice("avx2", dtypes, "AVX2 + FMA + F16C, no AVX-512 VNNI" + _bf16_note(features))
    why = f"no {', '.join(missing)}" if missing else "AVX2 kernel not built or kernels off"
    return Int4Choice(backend="aten", gemm_from_rows=0, gemm_dtype="", decode_gbps=0.0, gemm_gflops={},
                      reason=f"no AVX-512 VNNI; {why}")


def choose_backend(backend: str) -> Int4Choice:
    """The integer kernel `backend` asked for by name ("vnni", "avx2", "aten"), with this CPU's measured GEMMs."""
    if backend == "aten":
        return Int4Choice(backend="aten", gemm_from_rows=0, gemm_dtype="", decode_gbps=0.0, gemm_gflops={},
                          reason="asked for")
    features = cpu_features()
    return measured_choice(backend, gemm_dtypes(features) if int4_avx2.available() else (),
                           "asked for" + _bf16_note(features))


def _bf16_note(features: CpuFeatures) -> str:
    found = [name for name, present in (("AVX-512 BF16", features.avx512_bf16), ("AMX", features.amx)) if present]
    return f"; {' + '.join(found)}" if found else ""


@functools.cache
def measured_choice(backend: str, dtypes: tuple[str, ...], reason: str) -> Int4Choice:
    """The integer kernel `backend` with the GEMM dtype and threshold measured once per process on one thread
    (both ways split their work over threads alike, so the threshold holds at any count, and one thread on a
    shared machine is the least disturbed by other load), and logged."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        choice = with_threshold_override(_measured(backend, dtypes, reason))
    finally:
        torch.set_num_threads(saved)
    rates = ", ".join(f"{dtype} {rate:.1f}" for dtype, rate in choice.gemm_gflops.items())
    records = (f" (fed from the records by {int4_records.kernel_here()} below {choice.records_below} rows)"
               if choice.records_below else "")
    logger.info("int4 kernel: %s (%s); measured on 1 thread: decode by int8 dot products at %.2f GB/s of weights, "
                "dequantized GEMMs at %d rows %s GFLOP/s; %s GEMMs from %s rows%s", backend, reason,
                choice.decode_gbps, max(PROBE_ROWS), rates or "(none)", choice.gemm_dtype or "no",
                "no" if choice.gemm_from_rows == NEVER else choice.gemm_from_rows, records)
    return choice


def with_threshold_override(choice: Int4Choice) -> Int4Choice:
    """`choice` with the threshold THRESHOLD_ENV names (cpllm/config/int4_threshold.py), where it is set and the
    choice has GEMMs to switch to."""
    rows = threshold_override()
    if rows is None or not choice.gemm_dtype:
        return choice
    return dataclasses.replace(choice, gemm_from_rows=rows, reason=f"{choice.reason}; threshold from {THRESHOLD_ENV}")


def _probe_weight(seed: int) -> torch.Tensor:
    """A random packed int4 weight of PROBE_SHAPE."""
    out_features, in_features = PROBE_SHAPE
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, PROBE_SHAPE, dtype=torch.uint8, generator=gen)
    d = torch.rand(out_features, in_features // 32, generator=gen) * 0.01
    return int4_matmul.pack(codes, d, -8 * d)


def _measured(backend: str, dtypes: tuple[str, ...], reason: str) -> Int4Choice:
    out_features, in_features = PROBE_SHAPE
    packed = _probe_weight(0)
    x = torch.randn(max(PROBE_ROWS), in_features, generator=torch.Generator().manual_seed(0))
    integer = int4_gemm.INTEGER_KERNELS[backend]
    int_one = _best_seconds([lambda: integer(x[:1], packed, out_features)])[0]
    per_row = []  # (integer, gemm in each dtype...) seconds per row at each probed count
    for rows in PROBE_ROWS:
        calls = [lambda: integer(x[:rows], packed, out_features)]
        calls += [lambda dtype=int4_gemm.GEMM_DTYPES[name]: int4_gemm.dequantized_matmul(x[:rows], packed,
                                                                                         out_features, dtype)
                  for name in dtypes]
        per_row.append([seconds / rows for seconds in _best_seconds(calls)])
    flops = 2 * out_features * in_features
    gflops = {name: round(flops / per_row[-1][1 + i] / 1e9, 1) for i, name in enumerate(dtypes)}
    records_below = 0
    if "bfloat16" in dtypes and int4_records.available():
        records_below, bf16_per_row = _records_below()
        column = 1 + dtypes.index("bfloat16")
        for rows, times in zip(PROBE_ROWS, per_row):  # the bf16 way's time: whichever form runs at that count
            times[column] = bf16_per_row.get(rows, times[column])
    gemm_from_rows, gemm_dtype = NEVER, ""
    if dtypes:
        best = min(range(len(dtypes)), key=lambda i: per_row[-1][1 + i])
        gemm_dtype = dtypes[best]
        # the threshold with the least time per row summed over the probes: one noisy probe cannot move it far
        limits = [r for r in PROBE_ROWS if gemm_dtype != "bfloat16" or r >= BF16_MIN_ROWS]
        costs = {limit: sum(times[1 + best] if rows >= limit else times[0] for rows, times in zip(PROBE_ROWS, per_row))
                 for limit in (*limits, NEVER)}
        gemm_from_rows = min(costs, key=costs.get)
    return Int4Choice(backend=backend, gemm_from_rows=gemm_from_rows, gemm_dtype=gemm_dtype,
                      decode_gbps=round(packed.numel() / int_one / 1e9, 2), gemm_gflops=gflops,
                      records_below=records_below if gemm_dtype == "bfloat16" else 0, reason=reason)


def _records_below() -> tuple[int, dict[int, float]]:
    """(the row count below which the record-fed kernel runs, {rows: seconds per row of the bf16 way that runs
    there}) from both bf16 ways timed at RECORD_PROBE_ROWS: the bound with the least time per row summed over those
    counts."""
    out_features, in_features = PROBE_SHAPE
    per_row = {}  # rows -> (records, dequantize + GEMM) seconds per row
    weights = [_probe_weight(seed) for seed in range(COLD_WEIGHTS)]
    xb = torch.randn(max(RECORD_PROBE_ROWS), in_features, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    for rows in RECORD_PROBE_ROWS:
        calls = [lambda: [int4_records.matmul(xb[:rows], w, out_features, native=True) for w in weights],
                 lambda: [int4_gemm.dequantized_matmul(xb[:rows], w, out_features, torch.bfloat16, native=True)
                          for w in weights]]
        per_row[rows] = [seconds / rows / len(weights) for seconds in _best_seconds(calls, rounds=2)]
    # no bound past the largest probe (itself included): beyond it nothing was measured, and both record-fed kernels
    # fall behind oneDNN as rows grow (the tiles from 2,048 rows on a Sapphire Rapids core, the dot products from
    # 8,192 on a Zen 4 core)
    costs = {bound: sum(times[0] if rows < bound else times[1] for rows, times in per_row.items())
             for bound in RECORD_BOUNDS}
    bound = min(costs, key=costs.get)
    bound = 0 if bound == min(RECORD_PROBE_ROWS) else bound  # below the smallest probe: they never paid
    return bound, {rows: times[0] if rows < bound else times[1] for rows, times in per_row.items()}


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
