"""`cpllm plan --calibrate`: this machine's figures, measured, as a HardwareSpec (one device = one rank).

- peak_flops: with a model, the rate of one layer's projections as cpllm runs them (`x @ W`, W stored
  [in, out], q|k|v and gate|up packed) on 1,024 rows, at the rank's thread count; without one, the best square
  float32 matmul (bench.ceiling.matmul_gflops). A 2048-square matmul runs faster than SmolLM2's thin layers, and
  the prediction is only as good as the rate of the shapes it multiplies.
- attention_flops and attention_row_overhead: the prefill attention a GQA layer runs (cpllm's C kernel in
  float32 where it is built, else PyTorch's CPU flash kernel; with log-sum-exp, as cpllm calls it) with the
  model's heads on causal prompts of 1,024 and 4,096 tokens, solved for a rate per kept query-key pair and the
  extra work per query row of the diagonal's blocks;
- elementwise_bw: one layer's norms, residual adds, rope, layout copies, gated activation and K/V store on 1,024
  rows, in bytes/s as the cost model counts their bytes;
- busy_node_fraction: the projections' rate in two processes computing at once (this machine's cores share
  memory bandwidth and clocks), over the rate alone measured just before it, the median of rounds; it applies
  to layouts of more than one device;
- memory_bw: matrix-vector streaming rate (bench.ceiling.matvec_gbps);
- intra/inter-node bandwidth and latency: gloo point-to-point between two processes on this machine, the
  transfer the pass-KV and pass-Q rings make (8 MiB messages for bandwidth, 4-byte ones for latency);
- devices_per_node: the cores divided by the threads per rank.

Rates are medians of repeated runs, not the fastest: on a machine shared with other work the median is what a
long prefill gets, the fastest run only a quiet moment.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass

import torch

from cpllm.bench.ceiling import matmul_gflops, matvec_gbps
from cpllm.config.engine import ModelConfig
from cpllm.layers.gqa.local_attention import attend
from cpllm.planner.calibrate_pair import pair_figures
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
    hidden: int = 576
    intermediate: int = 1536

    @classmethod
    def of(cls, model: ModelConfig | None) -> "Shapes | None":
        if model is None:
            return None
        h, d = model.hidden_size, model.head_dim
        hq, hkv = model.num_attention_heads, model.num_key_value_heads
        return cls(weights=((h, (hq + 2 * hkv) * d), (hq * d, h), (h, 2 * model.intermediate_size),
                            (model.intermediate_size, h)), heads=hq, kv_heads=hkv, head_dim=d, hidden=h,
                   intermediate=model.intermediate_size)


def _typical(fn, repeats: int = REPEATS) -> float:
    """The median time of `repeats` runs: the rate this machine gives now, as a prefill of many such operations
    will see it (the fastest run would report a quiet moment of a busy machine)."""
    fn()  # warm-up: thread pool, page faults
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def linear_gflops(threads: int, shapes: Shapes | None) -> float:
    """GFLOP/s of one layer's projections on LINEAR_ROWS rows (a square matmul without shapes)."""
    if shapes is None:
        return matmul_gflops(threads)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        pairs = [(torch.randn(LINEAR_ROWS, k), torch.randn(k, n)) for k, n in shapes.weights]
        seconds = _typical(lambda: [x @ w for x, w in pairs])
    finally:
        torch.set_num_threads(saved)
    return sum(2.0 * LINEAR_ROWS * k * n for k, n in shapes.weights) / seconds / 1e9


def _attention_seconds(tokens: int, heads: int, kv_heads: int, dim: int) -> float:
    # the call a GQA layer's prefill makes: cpllm's C kernel where it runs, else PyTorch's flash kernel
    q, k, v = torch.randn(tokens, heads, dim), torch.randn(tokens, kv_heads, dim), torch.randn(tokens, kv_heads, dim)
    return _typical(lambda: attend(q, k, v, dim**-0.5, True), repeats=3)


def attention_figures(threads: int, shapes: Shapes | None = None, *, sizes: tuple[int, int] = (1024, 4096)
                      ) -> tuple[float, float]:
    """(GFLOP/s per kept query-key pair, extra key positions per query row) of the causal flash-attention
    kernel: time = k * (pairs + overhead * rows), solved from two sizes (the kernel's rate grows with the prompt,
    because the diagonal's blocks are computed whole; one rate at one size misjudges 8K by ~15%)."""
    heads, kv_heads, dim = (shapes.heads, shapes.kv_heads, shapes.head_dim) if shapes else (9, 3, 64)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        (t1, t2), (n1, n2) = [_attention_seconds(n, heads, kv_heads, dim) for n in sizes], sizes
    finally:
        torch.set_num_threads(saved)
    p1, p2 = n1 * (n1 + 1) / 2, n2 * (n2 + 1) / 2
    overhead = max(0.0, (t2 * p1 - t1 * p2) / (t1 * n2 - t2 * n1))
    per_pair = t2 / (p2 + overhead * n2)
    return 4.0 * dim * heads / per_pair / 1e9, overhead


def elementwise_gbps(threads: int, shapes: Shapes | None, *, rows: int = 1024) -> float:
    """Bytes/s of one layer's non-matmul work on `rows` tokens (norms, residual adds, rope, layout copies, gated
    activation, K/V store), counted as CostModel.elementwise_bytes_per_token counts them."""
    from cpllm.planner.cost_model import CostModel, Precision
    from cpllm.planner.hardware import builtin_hardware

    sh = shapes or Shapes(weights=())
    h, d, hq, hkv, inter = sh.hidden, sh.head_dim, sh.heads, sh.kv_heads, sh.intermediate
    x, w = torch.randn(rows, h), torch.randn(h)
    qkv, gate, up = torch.randn(rows, hq + 2 * hkv, d), torch.randn(rows, inter), torch.randn(rows, inter)
    cos, sin = torch.randn(rows, 1, d // 2), torch.randn(rows, 1, d // 2)
    pool, slots = torch.empty(rows, hkv, d), torch.arange(rows)

    def layer_ops():
        for _ in range(2):
            y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w
            x.add(y)
        for part in (qkv[:, :hq], qkv[:, hq:hq + hkv]):
            a, b = part.chunk(2, -1)
            rotated = torch.cat((a * cos - b * sin, b * cos + a * sin), -1)
        for part in (rotated, qkv[:, hq:hq + hkv], qkv[:, hq + hkv:], qkv[:, :hq]):
            part.transpose(0, 1).contiguous()
        torch.nn.functional.silu(gate) * up
        pool.index_copy_(0, slots, qkv[:, hq:hq + hkv])

    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        seconds = _typical(layer_ops)
    finally:
        torch.set_num_threads(saved)
    fp32 = Precision(weight_format="fp32", activation_bytes=4, kv_bytes=4)
    counted = CostModel(_shape_model(sh), builtin_hardware("cpu"), fp32).elementwise_bytes_per_token()
    return counted * rows / seconds / 1e9


def _shape_model(sh: Shapes) -> ModelConfig:
    return ModelConfig.from_hf_config(dict(
        architectures=["LlamaForCausalLM"], vocab_size=32, hidden_size=sh.hidden, intermediate_size=sh.intermediate,
        num_hidden_layers=1, num_attention_heads=sh.heads, num_key_value_heads=sh.kv_heads,
        head_dim=sh.head_dim, max_position_embeddings=4096))


def calibrate(threads_per_rank: int = 1, model: ModelConfig | None = None) -> HardwareSpec:
    shapes = Shapes.of(model)
    bandwidth, latency, busy_share = pair_figures(threads_per_rank, shapes, linear_gflops)
    alone = linear_gflops(threads_per_rank, shapes)
    attention, overhead = attention_figures(threads_per_rank, shapes)
    cores = os.cpu_count() or 1
    return HardwareSpec(
        name=f"calibrated-{threads_per_rank}t", peak_flops=alone * 1e9,
        attention_flops=attention * 1e9, attention_row_overhead=overhead,
        elementwise_bw=elementwise_gbps(threads_per_rank, shapes) * 1e9,
        busy_node_fraction=busy_share, memory_bytes=_memory_bytes(),
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
