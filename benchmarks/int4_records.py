"""The int4 layers' prefill GEMM: the kernel fed straight from the int4 records against dequantization and oneDNN.

    python benchmarks/int4_records.py --rows 64,128,256,512,1024,2048 --threads 1,2 \
        --json benchmarks/results/int4_records.json

Both sides multiply bf16 activations by the same random 4-bit groups: `records` is the record-fed kernel this CPU
runs (cpllm/kernels/int4_records.py: AMX tiles, int4_amx.c, or else AVX-512 BF16 dot products, int4_dpbf16.c; each
group of 16 output rows x 32 inputs dequantized into one operand in L2), `dequantize + oneDNN` is
`int4_gemm.dequantized_matmul` in bfloat16 (the whole weight dequantized, then torch's GEMM). One pass is SmolLM2's
four projections (q|k|v, o, gate|up, down) over 30 layers with their own weights, so weights come from memory as
in a prefill. The sides alternate in rounds; each cell keeps its fastest. `differing` is the fraction of outputs
whose bf16 bits differ between the sides (accumulation order; each is within a bf16 rounding of the exact product).
Needs a CPU with AMX or AVX-512 BF16 (the script says so and exits elsewhere); the JSON names the kernel.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from cpllm.bench.common import machine_info, parse_int_list
from cpllm.bench.report import print_table, write_json
from cpllm.kernels import int4_gemm, int4_matmul, int4_records

LAYERS = 30
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
"""(out, in) of each linear of a SmolLM2 layer: q|k|v, o, gate|up, down."""


def _weights() -> list[tuple[torch.Tensor, int]]:
    gen = torch.Generator().manual_seed(0)
    weights = []
    for _ in range(LAYERS):
        for out_features, in_features in SHAPES:
            codes = torch.randint(0, 16, (out_features, in_features), dtype=torch.uint8, generator=gen)
            d = torch.rand(out_features, in_features // 32, generator=gen) * 0.01
            weights.append((int4_matmul.pack(codes, d, -8 * d), out_features))
    return weights


def _sides() -> dict:
    return {"records": lambda x, packed, n: int4_records.matmul(x, packed, n, native=True),
            "dequantize + oneDNN": lambda x, packed, n: int4_gemm.dequantized_matmul(x, packed, n, torch.bfloat16,
                                                                                     native=True)}


def measure(rows: int, threads: int, weights: list, rounds: int) -> list[dict]:
    torch.set_num_threads(threads)
    inputs = {k: torch.randn(rows, k).to(torch.bfloat16) for k in {k for _, k in SHAPES}}
    sides = _sides()
    first, n = weights[2]  # a gate|up weight: do the sides agree?
    a, b = (call(inputs[SHAPES[2][1]], first, n) for call in sides.values())
    differing = (a != b).float().mean().item()
    best = {name: float("inf") for name in sides}
    for _ in range(rounds):
        for name, call in sides.items():
            start = time.perf_counter()
            for i, (packed, out_features) in enumerate(weights):
                call(inputs[SHAPES[i % len(SHAPES)][1]], packed, out_features)
            best[name] = min(best[name], time.perf_counter() - start)
    flops = 2 * rows * LAYERS * sum(o * i for o, i in SHAPES)
    base = best["dequantize + oneDNN"]
    return [{"rows": rows, "threads": threads, "system": name, "ms": round(1000 * s, 1),
             "gflops": round(flops / s / 1e9, 1), "time_vs_onednn": round(s / base, 2),
             "differing": round(differing, 6)} for name, s in best.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="64,128,256,512,1024,2048")
    parser.add_argument("--threads", default="1")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default="benchmarks/results/int4_records.json")
    args = parser.parse_args()
    kernel = int4_records.kernel_here()
    if kernel is None:
        sys.exit("int4_records: this CPU (or OS) runs neither AMX tiles nor AVX-512 BF16; nothing to measure")
    weights = _weights()
    rows = [row for threads in parse_int_list(args.threads, "--threads")
            for count in parse_int_list(args.rows, "--rows") for row in measure(count, threads, weights, args.rounds)]
    print_table("int4 prefill GEMMs, SmolLM2's 30 layers", rows)
    write_json(args.json, {"command": "int4_records", "kernel": kernel,
                           "cpllm": os.path.dirname(__import__("cpllm").__file__), "machine": machine_info(),
                           "results": rows})


if __name__ == "__main__":
    main()
