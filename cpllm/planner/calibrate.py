"""`cpllm plan --calibrate`: this machine's figures, measured, as a HardwareSpec (one device = one rank).

- peak_flops: with a model, the rate of one layer's projections as cpllm runs them (`x @ W`, W stored
  [in, out], q|k|v and gate|up packed) on 1,024 rows, at the rank's thread count; without one, the best square
  float32 matmul (bench.ceiling.matmul_gflops). A 2048-square matmul runs faster than SmolLM2's thin layers, and
  the prediction is only as good as the rate of the shapes it multiplies.
- attention_flops: the CPU flash-attention kernel (with log-sum-exp, as cpllm calls it) on a causal 2048-token
  block with the model's heads (SmolLM2's 9 query / 3 KV heads of 64 without a model);
- busy_node_fraction: the projections' rate in two processes computing at once (this machine's cores share
  memory bandwidth and clocks), over the rate alone; it applies to layouts of more than one device;
- memory_bw: matrix-vector streaming rate (bench.ceiling.matvec_gbps);
- intra/inter-node bandwidth and latency: gloo point-to-point between two processes on this machine, the
  transfer the pass-KV and pass-Q rings make (8 MiB messages for bandwidth, 4-byte ones for latency);
- devices_per_node: the cores divided by the threads per rank.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from cpllm.bench.ceiling import matmul_gflops, matvec_gbps
from cpllm.config import ModelConfig
from cpllm.context_parallel.sdpa import attention_with_lse
from cpllm.planner.hardware import HardwareSpec

REPEATS = 5
LINEAR_ROWS = 1024


@dataclass(kw_only=True, frozen=True, slots=True)
class Shapes:
    """What calibration multiplies: one layer's projections and its attention heads (picklable for the
    processes that measure the busy rate)."""

    weights: tuple[tuple[int, int], ...]
    """[in, out] of each projection of one layer."""
    heads: int = 9
    kv_heads: int = 3
    head_dim: int = 64

    @classmethod
    def of(cls, model: ModelConfig | None) -> "Shapes | None":
        if model is None:
            return None
        h, d = model.hidden_size, model.head_dim
        hq, hkv = model.num_attention_heads, model.num_key_value_heads
        return cls(weights=((h, (hq + 2 * hkv) * d), (hq * d, h), (h, 2 * model.intermediate_size),
                            (model.intermediate_size, h)), heads=hq, kv_heads=hkv, head_dim=d)


def _best(fn, repeats: int = REPEATS) -> float:
    fn()  # warm-up: thread pool, page faults
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def linear_gflops(threads: int, shapes: Shapes | None) -> float:
    """GFLOP/s of one layer's projections on LINEAR_ROWS rows (a square matmul without shapes)."""
    if shapes is None:
        return matmul_gflops(threads)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        pairs = [(torch.randn(LINEAR_ROWS, k), torch.randn(k, n)) for k, n in shapes.weights]
        seconds = _best(lambda: [x @ w for x, w in pairs])
    finally:
        torch.set_num_threads(saved)
    return sum(2.0 * LINEAR_ROWS * k * n for k, n in shapes.weights) / seconds / 1e9


def attention_gflops(threads: int, shapes: Shapes | None = None, *, tokens: int = 2048) -> float:
    heads, kv_heads, dim = (shapes.heads, shapes.kv_heads, shapes.head_dim) if shapes else (9, 3, 64)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q = torch.randn(1, heads, tokens, dim)
        k, v = torch.randn(1, kv_heads, tokens, dim), torch.randn(1, kv_heads, tokens, dim)
        seconds = _best(lambda: attention_with_lse(q, k, v, scale=dim**-0.5, causal=True))
    finally:
        torch.set_num_threads(saved)
    return 4.0 * dim * heads * tokens * (tokens + 1) / 2 / seconds / 1e9


def calibrate(threads_per_rank: int = 1, model: ModelConfig | None = None) -> HardwareSpec:
    from cpllm.planner.calibrate_pair import pair_figures

    shapes = Shapes.of(model)
    bandwidth, latency, busy = pair_figures(threads_per_rank, shapes)
    alone = linear_gflops(threads_per_rank, shapes)
    cores = os.cpu_count() or 1
    return HardwareSpec(
        name=f"calibrated-{threads_per_rank}t", peak_flops=alone * 1e9,
        attention_flops=attention_gflops(threads_per_rank, shapes) * 1e9,
        busy_node_fraction=min(1.0, busy / alone), memory_bytes=_memory_bytes(),
        memory_bw=matvec_gbps(threads_per_rank) * 1e9, intra_node_bw=bandwidth, inter_node_bw=bandwidth,
        devices_per_node=max(1, cores // threads_per_rank), intra_node_latency_s=latency,
        inter_node_latency_s=latency,
    )


def _memory_bytes() -> float:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024.0
    raise RuntimeError("cannot read MemTotal from /proc/meminfo")
