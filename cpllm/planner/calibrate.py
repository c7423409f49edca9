"""`cpllm plan --calibrate`: this machine's figures, measured, as a HardwareSpec (one device = one rank).

- peak_flops: best float32 matmul rate at the rank's thread count (bench.ceiling.matmul_gflops);
- attention_flops: the CPU flash-attention kernel (with log-sum-exp, as cpllm calls it) on a causal
  2048-token, 9-query-head / 3-KV-head block of width 64 (SmolLM2's heads);
- memory_bw: matrix-vector streaming rate (bench.ceiling.matvec_gbps);
- intra/inter-node bandwidth and latency: gloo point-to-point between two processes on this machine, the
  transfer the pass-KV and pass-Q rings make (8 MiB messages for bandwidth, 4-byte ones for latency);
- devices_per_node: the cores divided by the threads per rank.
"""

from __future__ import annotations

import os
import time

import torch

from cpllm.bench.ceiling import matmul_gflops, matvec_gbps
from cpllm.context_parallel.sdpa import attention_with_lse
from cpllm.planner.hardware import HardwareSpec

BANDWIDTH_BYTES = 8 * 2**20
REPEATS = 5


def attention_gflops(threads: int, *, tokens: int = 2048, heads: int = 9, kv_heads: int = 3, dim: int = 64) -> float:
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q = torch.randn(1, heads, tokens, dim)
        k, v = torch.randn(1, kv_heads, tokens, dim), torch.randn(1, kv_heads, tokens, dim)
        attention_with_lse(q, k, v, scale=dim**-0.5, causal=True)  # warm-up
        best = float("inf")
        for _ in range(REPEATS):
            start = time.perf_counter()
            attention_with_lse(q, k, v, scale=dim**-0.5, causal=True)
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(saved)
    return 4.0 * dim * heads * tokens * (tokens + 1) / 2 / best / 1e9


def _p2p_rank(rank: int, port: int, results) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        out = {}
        for name, nbytes in (("latency", 4), ("bandwidth", BANDWIDTH_BYTES)):
            send, recv = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
            best = float("inf")
            for _ in range(REPEATS + 1):
                dist.barrier()
                start = time.perf_counter()
                ops = [dist.P2POp(dist.isend, send, 1 - rank), dist.P2POp(dist.irecv, recv, 1 - rank)]
                for work in dist.batch_isend_irecv(ops):
                    work.wait()
                best = min(best, time.perf_counter() - start)
            out[name] = best
        if rank == 0:
            results.put(out)
    finally:
        dist.destroy_process_group()


def p2p_figures() -> tuple[float, float]:
    """(bytes/s, latency s) of gloo point-to-point between two processes of this machine."""
    import torch.multiprocessing as mp

    from cpllm.distributed.launch import find_free_port

    ctx = mp.get_context("spawn")
    results, port = ctx.Queue(), find_free_port()
    procs = [ctx.Process(target=_p2p_rank, args=(rank, port, results), daemon=True) for rank in range(2)]
    for proc in procs:
        proc.start()
    try:
        out = results.get(timeout=120)
    finally:
        for proc in procs:
            proc.join(30)
    latency = out["latency"]
    return BANDWIDTH_BYTES / max(out["bandwidth"] - latency, 1e-9), latency


def calibrate(threads_per_rank: int = 1) -> HardwareSpec:
    bandwidth, latency = p2p_figures()
    cores = os.cpu_count() or 1
    return HardwareSpec(
        name=f"calibrated-{threads_per_rank}t", peak_flops=matmul_gflops(threads_per_rank) * 1e9,
        attention_flops=attention_gflops(threads_per_rank) * 1e9, memory_bytes=_memory_bytes(),
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
