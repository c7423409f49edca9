"""PCP=2 prefill efficiency on the default weights: wall and CPU seconds of one rank against PCP=2.

    python benchmarks/pcp_efficiency.py --tokens 4096 --rounds 3 --json benchmarks/results/pcp_efficiency.json

One thread per rank, SmolLM2 with `--quantization auto` (the GGUF's int4 weights as stored). The one-rank engine is
built once and each PCP=2 strategy's engine in turn (warmed up); the rounds alternate between the one rank and the
strategy on the same fresh prompts, so the machine's drift touches both alike; the fastest round is a TTFT, and
each strategy's efficiency is read against the one rank's fastest round of its own block. Efficiency is
TTFT(1 rank) / (2 TTFT(PCP=2)). Beside the wall time it reports the CPU seconds (user + system) of every process
of the engine, read from /proc: on a busy machine those move far less than the wall time, and their sum against
the one rank's says how much work PCP adds (merges, collectives, Python) apart from waiting. With --concurrent,
two independent one-rank engines prefill at once, one per core: one engine alone against them bounds what any
two-rank layout can reach on this machine, before a single collective.

To compare two commits, run the script of the newer one with `PYTHONPATH` set to a worktree of the older one
(both import their own `cpllm`), alternating, and give each run its own `--json`.
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

TICK = os.sysconf("SC_CLK_TCK")


def process_tree(pid: int) -> list[int]:
    """`pid` and every descendant (the rank processes)."""
    pids = [pid]
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                children = f.read().split()
        except OSError:
            children = []
        for child in children:
            pids += process_tree(int(child))
    return pids


def cpu_seconds(pids: list[int]) -> dict[int, float]:
    """User + system seconds of each live process."""
    out = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[pid] = (int(fields[11]) + int(fields[12])) / TICK
    return out


def build(pcp: int, strategy: str, tokens: int):
    """One layout's engine, warmed up."""
    config = model_config_of(None)
    layout = BenchLayout.of(tp=1, pcp=pcp, threads_per_rank=1)
    llm, _ = build_llm(None, layout, strategy=strategy if pcp > 1 else None, threads_per_rank=1,
                       context_tokens=tokens + 16, batch_tokens=tokens + 16,
                       engine_options={"quantization": "auto"})
    time_prefill(llm, random_prompt(WARMUP_TOKENS, config.vocab_size, seed=-1))
    return llm


def one_round(llm, tokens: int, seed: int, ranks: bool) -> dict:
    """Wall and CPU seconds of one fresh prompt's prefill: of this process alone (the one-rank engine runs in it),
    or with `ranks` of its rank processes too (a PCP engine's rank 0 runs here, the others in child processes,
    which wait between its prefills)."""
    config = model_config_of(None)
    pids = process_tree(os.getpid()) if ranks else [os.getpid()]
    before, start = cpu_seconds(pids), time.perf_counter()
    time_prefill(llm, random_prompt(tokens, config.vocab_size, seed=seed))
    wall, after = time.perf_counter() - start, cpu_seconds(pids)
    per_process = sorted((after[p] - before[p] for p in after if p in before), reverse=True)
    return {"wall_s": round(wall, 3), "cpu_s": round(sum(per_process), 3),
            "cpu_s_per_process": [round(x, 3) for x in per_process if x > 0.05]}


def measure(strategies: list[str], tokens: int, rounds: int) -> list[dict]:
    """The one-rank engine built once; each PCP=2 strategy's engine in turn (one multi-rank engine per process),
    its rounds alternating with the one rank's on the same fresh prompts, so the machine's drift touches both alike.
    Each PCP row carries the one rank's fastest round of its own block (`one_rank_ttft_s`)."""
    single = build(1, "-", tokens)
    rows, single_runs = [], []
    try:
        for strategy in strategies:
            pcp = build(2, strategy, tokens)
            try:
                pairs = [(one_round(single, tokens, seed=r, ranks=False), one_round(pcp, tokens, seed=r, ranks=True))
                         for r in range(rounds)]
                ran = {name: count for name, count in pcp.engine.executor.rank_stats().strategy_counts.items() if count}
            finally:
                pcp.shutdown()
            single_runs += [one for one, _ in pairs]
            rows.append({"pcp": 2, "strategy": strategy, "ran": ran, "tokens": tokens,
                         "runs": [two for _, two in pairs],
                         "ttft_s": min(two["wall_s"] for _, two in pairs),
                         "one_rank_ttft_s": min(one["wall_s"] for one, _ in pairs),
                         "one_rank_cpu_s": min(one["cpu_s"] for one, _ in pairs)})
    finally:
        single.shutdown()
    one = {"pcp": 1, "strategy": "-", "tokens": tokens, "runs": single_runs,
           "ttft_s": min(run["wall_s"] for run in single_runs)}
    return [one, *rows]


def _concurrent_one_rank(core: int, tokens: int, rounds: int, barrier, out) -> None:
    """One one-rank engine pinned to `core`, each round's prefill started with the other's (the barrier)."""
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    config = model_config_of(None)
    llm, _ = build_llm(None, BenchLayout.of(tp=1, pcp=1, threads_per_rank=1), strategy=None, threads_per_rank=1,
                       context_tokens=tokens + 16, batch_tokens=tokens + 16, engine_options={"quantization": "auto"})
    try:
        time_prefill(llm, random_prompt(WARMUP_TOKENS, config.vocab_size, seed=-1))
        for r in range(rounds):
            barrier.wait(timeout=600)
            out.put((core, r, time_prefill(llm, random_prompt(tokens, config.vocab_size, seed=r))))
    finally:
        llm.shutdown()


def concurrent_bound(tokens: int, rounds: int) -> dict:
    """The machine's own bound on PCP=2 efficiency: two independent one-rank engines prefilling at once, one per
    core. Their TTFT against one engine alone is what running both cores costs each (shared caches, memory,
    clocks), before any collective."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    barrier, out = context.Barrier(2), context.Queue()
    workers = [context.Process(target=_concurrent_one_rank, args=(core, tokens, rounds, barrier, out))
               for core in (0, 1)]
    for worker in workers:
        worker.start()
    results = [out.get(timeout=1800) for _ in range(2 * rounds)]
    for worker in workers:
        worker.join(timeout=120)
    per_round = [max(t for _, r, t in results if r == k) for k in range(rounds)]
    return {"pcp": "2 x one rank", "strategy": "independent, at once", "tokens": tokens,
            "runs": [{"wall_s": round(t, 3)} for t in per_round], "ttft_s": round(min(per_round), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--strategies", default="ring", help="PCP=2 strategies, comma-separated")
    parser.add_argument("--concurrent", action="store_true",
                        help="also two independent one-rank engines at once, one per core: the machine's bound")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    load_start = [round(x, 2) for x in os.getloadavg()]
    rows = measure(args.strategies.split(","), args.tokens, args.rounds)
    for row in rows[1:]:
        row["efficiency"] = round(row["one_rank_ttft_s"] / (2 * row["ttft_s"]), 3)
        row["cpu_ratio"] = round(row["one_rank_cpu_s"] / min(r["cpu_s"] for r in row["runs"]), 3)
    if args.concurrent:
        bound = concurrent_bound(args.tokens, args.rounds)
        bound["bound_on_efficiency"] = round(rows[0]["ttft_s"] / bound["ttft_s"], 3)
        rows.append(bound)
    for row in rows:
        print(json.dumps(row), flush=True)
    payload = {"command": "pcp_efficiency", "argv": sys.argv, "cpllm": os.path.dirname(
        __import__("cpllm").__file__), "machine": {**machine_info(), "load_average_start": load_start},
        "results": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
