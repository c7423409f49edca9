"""Where a PCP=2 prefill's time goes, against one rank: torch.profiler on the driver rank of each engine.

    python benchmarks/profile_prefill.py --lengths 4096,8000 --json benchmarks/results/prefill_breakdown.json

One thread per rank, SmolLM2 in fp32 (--quantization none), PCP=2 with `--cp-prefill-strategy auto`. Each
engine is warmed up, then one fresh prompt per length is timed without the profiler (fastest of --repeats, the
TTFT) and once more under it. The profile of rank 0 is split by operator into linear layers (matmuls),
the attention kernel, collectives (gloo calls, including the time spent waiting for the other rank), and the
rest (norms, rope, activations, log-sum-exp merges, copies, indexing). The pad rows and the attention imbalance
of the head-tail split are counted from the partition itself (they are exact, no timing needed).

The page's table (benchmarks/report_cp.py) compares 2 x rank 0's time per category with the one-rank run: the
extra time of each is what the PCP=2 run pays beyond a perfect halving.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from cpllm.bench.common import BenchLayout, machine_info, random_prompt
from cpllm.bench.engines import build_llm, model_config_of
from cpllm.bench.prefill import WARMUP_TOKENS, time_prefill
from cpllm.context_parallel.partition import rank_token_ranges

CATEGORIES = {
    "linear": ("aten::mm", "aten::addmm", "aten::bmm", "aten::_weight_int4pack_mm_for_cpu",
               "cpllm::int4_dequantized_matmul"),  # the int4 prefill GEMMs' own C calls (dequantizer, record-fed)
    "attention kernel": ("aten::_scaled_dot_product_flash_attention_for_cpu", "cpllm::prefill_flash_attention"),
}
COLLECTIVE_MARKERS = ("gloo", "c10d", "wait", "broadcast", "all_gather", "all_to_all", "allreduce", "send", "recv")


def categorize(name: str) -> str:
    for category, names in CATEGORIES.items():
        if name in names:
            return category
    if any(marker in name.lower() for marker in COLLECTIVE_MARKERS):
        return "collectives"
    return "other ops"


def profile_once(llm, prompt: list[int]) -> dict[str, float]:
    """Seconds per category of one prefill on this process's rank (self CPU time of each operator)."""
    from torch.profiler import ProfilerActivity, profile

    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        time_prefill(llm, prompt)
    wall = time.perf_counter() - start
    out: dict[str, float] = {}
    for event in prof.key_averages():
        category = categorize(event.key)
        out[category] = out.get(category, 0.0) + event.self_cpu_time_total / 1e6
    out["untracked (python, scheduling)"] = max(0.0, wall - sum(out.values()))
    out["wall"] = wall
    return {k: round(v, 4) for k, v in out.items()}


def partition_counts(tokens: int, pcp: int) -> dict[str, float]:
    """Pad rows and the causal attention pairs of each rank under the head-tail split."""
    rows, pairs = [], []
    for rank in range(pcp):
        chunks = rank_token_ranges(tokens, pcp, rank)
        rows.append(sum(end - start for start, end in chunks))
        pairs.append(sum(sum(range(start + 1, end + 1)) for start, end in chunks))
    return {"rows_per_rank": rows, "pad_rows": max(rows) * pcp - tokens,
            "attention_pairs_per_rank": pairs,
            "attention_imbalance": round(max(pairs) / (sum(pairs) / pcp) - 1, 5)}


def run(lengths: list[int], repeats: int, engine_options: dict) -> list[dict]:
    config = model_config_of(None)
    rows = []
    for layout in (BenchLayout.of(tp=1, pcp=1, threads_per_rank=1), BenchLayout.of(tp=1, pcp=2, threads_per_rank=1)):
        llm, _ = build_llm(None, layout, strategy="auto" if layout.dims.pcp > 1 else None, threads_per_rank=1,
                           context_tokens=max(lengths) + 16, batch_tokens=max(lengths) + 16,
                           engine_options=engine_options)
        try:
            time_prefill(llm, random_prompt(WARMUP_TOKENS, config.vocab_size, seed=-1))
            for length in lengths:
                ttft = min(time_prefill(llm, random_prompt(length, config.vocab_size, seed=r * 7919 + length))
                           for r in range(repeats))
                profiled = profile_once(llm, random_prompt(length, config.vocab_size, seed=-length))
                rows.append({"layout": layout.label(), "prompt_tokens": length, "ttft_s": round(ttft, 4),
                             "rank0_profile_s": profiled, "partition": partition_counts(length, layout.dims.pcp),
                             "strategies_ran": dict(llm.engine.executor.rank_stats().strategy_counts)})
                print(json.dumps(rows[-1]), flush=True)
        finally:
            llm.shutdown()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="4096,8000")
    parser.add_argument("--repeats", type=int, default=2, help="unprofiled runs per length (the fastest is the TTFT)")
    parser.add_argument("--quantization", default="none")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    load_start = [round(x, 2) for x in os.getloadavg()]
    rows = run(lengths, args.repeats, {"quantization": args.quantization})
    payload = {"command": "profile_prefill", "argv": sys.argv, "machine": {**machine_info(),
               "load_average_start": load_start}, "results": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
