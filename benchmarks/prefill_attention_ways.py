"""Prefill attention in each way cpllm's kernel runs here, against PyTorch's SDPA in float32 and bfloat16.

    python benchmarks/prefill_attention_ways.py --lengths 2048,8192 --json benchmarks/results/attention_ways.json

One layer's causal attention of a prompt over itself with SmolLM2's heads (9 query, 3 KV of 64), on one thread:
the kernel's float32 way and each bf16 way this machine runs (`built_ways`: AMX tiles, vdpbf16ps), and PyTorch's
`scaled_dot_product_attention` (its CPU flash kernel, what transformers' sdpa runs) in float32 and in bfloat16
(`enable_gqa`). The systems alternate in rounds; a cell keeps its fastest round. `gflops`: the two products over
the visible half of the score matrix, over the time. To compare two commits, run this script with `PYTHONPATH`
set to each side's tree, in turn.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from cpllm.bench.common import machine_info, parse_int_list
from cpllm.bench.report import print_table, write_json
from cpllm.kernels.prefill_attention import built_ways, prefill_attention

HEADS = (9, 3, 64)
"""(query heads, KV heads, head size): SmolLM2's."""


def _systems(q, k, v) -> dict:
    """name -> a call of one causal attention."""
    scale = q.shape[-1] ** -0.5
    systems = {"cpllm float32": lambda: prefill_attention(q, k, v, scale, True)}
    for way in built_ways():
        systems[f"cpllm {way}"] = lambda way=way: prefill_attention(q, k, v, scale, True, bf16_products=True,
                                                                    bf16_way=way)
    for dtype, name in ((torch.float32, "torch sdpa float32"), (torch.bfloat16, "torch sdpa bfloat16")):
        qt, kt, vt = (t.transpose(0, 1)[None].to(dtype).contiguous() for t in (q, k, v))
        systems[name] = lambda qt=qt, kt=kt, vt=vt: torch.nn.functional.scaled_dot_product_attention(
            qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True)
    return systems


def measure(length: int, rounds: int) -> list[dict]:
    hq, hkv, d = HEADS
    gen = torch.Generator().manual_seed(length)
    q, k, v = (torch.randn(length, h, d, generator=gen) for h in (hq, hkv, hkv))
    systems = _systems(q, k, v)
    best = {name: float("inf") for name in systems}
    for name, call in systems.items():
        call()  # warm-up (and the kernel's build on first use)
    for _ in range(rounds):
        for name, call in systems.items():
            start = time.perf_counter()
            call()
            best[name] = min(best[name], time.perf_counter() - start)
    flops = 2 * 2 * (length * (length + 1) / 2) * d * hq
    return [{"system": name, "prompt_tokens": length, "threads": 1, "ms": round(1000 * s, 1),
             "gflops": round(flops / s / 1e9, 1)} for name, s in best.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="2048,8192")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default="benchmarks/results/attention_ways.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [row for length in parse_int_list(args.lengths, "--lengths") for row in measure(length, args.rounds)]
    print_table("prefill attention, 1 thread", rows)
    write_json(args.json, {"command": "prefill_attention_ways", "cpllm": os.path.dirname(
        __import__("cpllm").__file__), "machine": machine_info(), "results": rows})


if __name__ == "__main__":
    main()
