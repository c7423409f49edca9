"""Decode attention: the in-place C kernel against gathering the context and calling PyTorch's flash kernel.

    python benchmarks/decode_attention.py --json benchmarks/results/decode_attention.json

Both sides run the engine's entry point (`cpllm.layers.gqa.local_attention.attend_decode`), once with the
kernel and once with CPLLM_KERNELS=0 (index_select of the request's slots, widened to float32, then
`aten._scaled_dot_product_flash_attention_for_cpu`). SmolLM2's shapes (9 query heads, 3 KV heads of 64), one
request, its context in 16-slot blocks scattered over the pool as a paged cache leaves them, and one pool pair per
layer for 30 layers, so K/V come from memory as in a decode step, not from cache. The sides alternate in rounds;
each cell keeps its median round.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from cpllm.bench.common import machine_info
from cpllm.bench.report import print_table, write_json
from cpllm.layers.gqa.local_attention import attend_decode
from cpllm.context_parallel.metadata import DecodeBatch

LAYERS, HQ, HKV, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _decode_batch(context: int, num_slots: int, gen: torch.Generator) -> DecodeBatch:
    blocks = torch.randperm(num_slots // BLOCK, generator=gen)[: -(-context // BLOCK)]
    slots = (blocks.unsqueeze(1) * BLOCK + torch.arange(BLOCK)).reshape(-1)[:context].unsqueeze(0)
    return DecodeBatch(requests=(0,), slots=slots, key_mask=None, rows=torch.zeros(1, 1, dtype=torch.long),
                       max_local_context=context, lengths=torch.tensor([context]))


def _step_seconds(q, pools, decode, kernel: bool, steps: int) -> float:
    os.environ["CPLLM_KERNELS"] = "1" if kernel else "0"
    start = time.perf_counter()
    for _ in range(steps):
        for k_pool, v_pool in pools:
            attend_decode(q, k_pool, v_pool, decode, HEAD_DIM**-0.5, every_row_sees_a_key=True)
    return (time.perf_counter() - start) / steps


def measure(context: int, dtype: str, threads: int, rounds: int, steps: int) -> dict:
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(context)
    num_slots = 2 * context + 4 * BLOCK
    pools = [(torch.randn(num_slots, HKV, HEAD_DIM, generator=gen).to(DTYPES[dtype]),
              torch.randn(num_slots, HKV, HEAD_DIM, generator=gen).to(DTYPES[dtype])) for _ in range(LAYERS)]
    decode = _decode_batch(context, num_slots, gen)
    q = torch.randn(1, HQ, HEAD_DIM, generator=gen)
    times = {True: [], False: []}
    for _ in range(rounds):
        for kernel in (True, False):
            _step_seconds(q, pools, decode, kernel, 1)  # warm-up (and the kernel's build on first use)
            times[kernel].append(_step_seconds(q, pools, decode, kernel, steps))
    kernel_ms, flash_ms = (1000 * statistics.median(times[k]) for k in (True, False))
    kv_bytes = 2 * LAYERS * context * HKV * HEAD_DIM * DTYPES[dtype].itemsize
    return {"context_tokens": context, "kv_dtype": dtype, "threads": threads, "kernel_ms": round(kernel_ms, 3),
            "gather_flash_ms": round(flash_ms, 3), "speedup": round(flash_ms / kernel_ms, 2),
            "kernel_gb_per_s": round(kv_bytes / kernel_ms / 1e6, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", default="2048,8192")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5, help="30-layer passes per round")
    parser.add_argument("--json", default="benchmarks/results/decode_attention.json")
    args = parser.parse_args()
    rows = [measure(context, dtype, threads, args.rounds, args.steps)
            for threads in map(int, args.threads.split(",")) for context in map(int, args.contexts.split(","))
            for dtype in DTYPES]
    print_table("decode attention, one request, 30 layers", rows)
    write_json(args.json, {"command": "decode_attention", "machine": machine_info(), "results": rows})


if __name__ == "__main__":
    main()
