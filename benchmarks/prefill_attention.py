"""Prefill attention: cpllm's C kernel against PyTorch's CPU flash-attention kernel, on one prompt's causal block.

    python benchmarks/prefill_attention.py --json benchmarks/results/prefill_attention.json

Both sides run the engine's entry point (`cpllm.layers.gqa.local_attention.attend`), once with the kernel and
once with CPLLM_KERNELS=0 (`aten._scaled_dot_product_flash_attention_for_cpu`, what transformers' sdpa runs on the
CPU too). One layer's causal attention of a prompt over itself, q read in place inside the fused q|k|v rows as the
model hands it over, for SmolLM2's heads (9 query, 3 KV of 64) and the MoE benchmark's (16 query, 4 KV of 64). The
sides alternate in rounds; each cell keeps its median round. `gflops`: the causal attention's multiply-adds (the
two products over the visible half of the score matrix) over the time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from cpllm.bench.common import machine_info
from cpllm.bench.report import print_table, write_json
from cpllm.layers.gqa.local_attention import attend

SHAPES = {"smollm2": (9, 3, 64), "qwen3moe": (16, 4, 64)}
"""Model -> (query heads, KV heads, head size)."""


def _seconds(q, k, v, kernel: bool, calls: int) -> float:
    os.environ["CPLLM_KERNELS"] = "1" if kernel else "0"
    start = time.perf_counter()
    for _ in range(calls):
        attend(q, k, v, q.shape[-1] ** -0.5, causal=True)
    return (time.perf_counter() - start) / calls


def measure(model: str, length: int, threads: int, rounds: int) -> dict:
    torch.set_num_threads(threads)
    hq, hkv, d = SHAPES[model]
    gen = torch.Generator().manual_seed(length)
    qkv = torch.randn(length, (hq + 2 * hkv) * d, generator=gen)
    q = qkv[:, : hq * d].view(length, hq, d)
    k, v = (qkv[:, (hq + i * hkv) * d : (hq + (i + 1) * hkv) * d].reshape(length, hkv, d).contiguous()
            for i in (0, 1))
    calls = max(1, 4096 // length)
    times = {True: [], False: []}
    for _ in range(rounds):
        for kernel in (True, False):
            _seconds(q, k, v, kernel, 1)  # warm-up (and the kernel's build on first use)
            times[kernel].append(_seconds(q, k, v, kernel, calls))
    kernel_s, flash_s = (statistics.median(times[k]) for k in (True, False))
    flops = 2 * 2 * (length * (length + 1) / 2) * d * hq
    return {"model": model, "prompt_tokens": length, "threads": threads, "kernel_ms": round(1000 * kernel_s, 2),
            "torch_flash_ms": round(1000 * flash_s, 2), "speedup": round(flash_s / kernel_s, 2),
            "kernel_gflops": round(flops / kernel_s / 1e9, 1), "torch_flash_gflops": round(flops / flash_s / 1e9, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="1024,4096")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--models", default="smollm2,qwen3moe")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default="benchmarks/results/prefill_attention.json")
    args = parser.parse_args()
    rows = [measure(model, length, threads, args.rounds)
            for threads in map(int, args.threads.split(",")) for model in args.models.split(",")
            for length in map(int, args.lengths.split(","))]
    print_table("prefill attention, one layer, causal", rows)
    write_json(args.json, {"command": "prefill_attention", "machine": machine_info(), "results": rows})


if __name__ == "__main__":
    main()
