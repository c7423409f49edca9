"""Issue 38: the sparse-MLA indexer's top-k, cpllm's C kernel against its torch form and torch.topk.

    python benchmarks/index_topk_bench.py --threads 2 --rounds 3 --out benchmarks/results/index_topk.json

Three ways, taking turns in every round (the order reversing each round), each timed as the mean of `--calls` calls
after a warm-up, on random float32 scores with positions 0..T-1 and k = 2,048 (DeepSeek-V3.2's index_topk):
- `kernel`: cpllm/kernels/index_topk.c through `index_top_k` (a radix select on one 64-bit key per score and
  position, then a sort of the k taken), what the engine runs where the kernel is built;
- `torch_form`: `torch_top_k`, the kernel's fallback (two stable sorts of every row), which fixes the tie rule
  the kernel reproduces bit for bit (tests/test_index_topk_kernel.py);
- `torch_topk`: `torch.topk` with sorted output, which has no tie rule (the same scores, positions may differ on
  ties): the library's own selection, for scale.
The workloads: one decode query over 16K and 64K keys, and a 300-row prefill chunk over 8K keys. A figure is the
median of the rounds; the JSON keeps every round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from cpllm.bench.common import machine_info
from cpllm.kernels.index_topk import index_top_k
from cpllm.layers.sparse_mla.topk import torch_top_k

WORKLOADS = (("decode: 1 row x 16,384", 1, 16384), ("decode: 1 row x 65,536", 1, 65536),
             ("prefill: 300 rows x 8,192", 300, 8192))


def _mean_ms(fn, calls: int) -> float:
    fn()  # warm-up
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


def _ways(scores: torch.Tensor, positions: torch.Tensor, k: int) -> dict:
    def kernel():
        if index_top_k(scores, positions, k) is None:
            raise SystemExit("the index top-k kernel does not run here (kernels off or not built)")

    return {"kernel": kernel, "torch_form": lambda: torch_top_k(scores, positions, k),
            "torch_topk": lambda: torch.topk(scores, min(k, scores.shape[1]), dim=1, sorted=True)}


def run(rounds: int, calls: int, k: int) -> list[dict]:
    rows = []
    for name, length, width in WORKLOADS:
        gen = torch.Generator().manual_seed(width + length)
        scores = torch.randn(length, width, generator=gen)
        positions = torch.arange(width).expand(length, width)  # [L, T], as the indexer passes them
        ways = _ways(scores, positions, k)
        times: dict[str, list[float]] = {way: [] for way in ways}
        for r in range(rounds):
            for way in (list(ways) if r % 2 == 0 else list(reversed(ways))):
                times[way].append(round(_mean_ms(ways[way], calls), 4))
        median = {way: statistics.median(t) for way, t in times.items()}
        rows.append({"workload": name, "rows": length, "keys": width, "k": k,
                     **{f"{way}_ms": round(ms, 4) for way, ms in median.items()},
                     "torch_form_over_kernel": round(median["torch_form"] / median["kernel"], 2),
                     "torch_topk_over_kernel": round(median["torch_topk"] / median["kernel"], 2),
                     "rounds_ms": times})
        print(f"{name}: " + ", ".join(f"{way} {ms:.3f} ms" for way, ms in median.items()), file=sys.stderr)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=5, help="calls per timing (their mean)")
    parser.add_argument("--k", type=int, default=2048, help="tokens kept (DeepSeek-V3.2: 2048)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    machine = machine_info()
    machine["load_average_start"] = machine.pop("load_average")
    rows = run(args.rounds, args.calls, args.k)
    machine["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    with open(args.out, "w") as f:
        json.dump({"argv": ["python", "benchmarks/index_topk_bench.py", *sys.argv[1:]], "threads": args.threads,
                   "machine": machine, "topk": rows}, f, indent=1)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
