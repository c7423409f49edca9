"""The figures a structural change must not move, for an older commit and the working tree, in one run, alternating.

    python benchmarks/structure_before_after.py --before 45527f0 --rounds 3 --out benchmarks/results/structure.json

The older commit's `cpllm/` is extracted with `git archive` and put first on PYTHONPATH. Every case is one bench
command run in its own process for each side; in each round the cases run in order and the two sides take turns
going first, so that a change in machine load touches both. A figure is the median over the rounds, and `ratio` is
after / before of those medians (decode: tokens/s, higher is better; prefill: TTFT, lower is better).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from cpllm.bench.common import machine_info

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BENCH = [sys.executable, "-m", "cpllm", "--log-level", "WARNING", "bench"]


@dataclass(frozen=True)
class Case:
    """One bench command and the figure read from its JSON."""

    name: str
    """What the row measures, as the table shows it."""
    argv: tuple[str, ...]
    """The command; `{json}` is replaced by the file it writes."""
    metric: str
    """`tokens_per_s` (decode) or `ttft_s` (prefill)."""


DECODE = ("decode", "--layouts", "1x1x1@2", "--batch-sizes", "1,16", "--context-lengths", "128", "--steps", "32")
CASES = (
    Case("decode, one rank, auto", (*BENCH, *DECODE, "--quantization", "auto", "--json", "{json}"), "tokens_per_s"),
    Case("decode, one rank, none", (*BENCH, *DECODE, "--quantization", "none", "--json", "{json}"), "tokens_per_s"),
    Case("prefill 2K, one rank", (*BENCH, "prefill", "--lengths", "2048", "--layouts", "1x1x1@2", "--repeats", "1",
                                  "--no-ceiling", "--json", "{json}"), "ttft_s"),
    Case("TTFT 4K, PCP=2", (*BENCH, "prefill", "--lengths", "4096", "--layouts", "1x2x1@1", "--strategies", "auto",
                            "--repeats", "1", "--no-ceiling", "--json", "{json}"), "ttft_s"),
    Case("decode, PCP team (2048 ctx)", (*BENCH, "decode", "--layouts", "1x2x1@1", "--batch-sizes", "1,16",
                                         "--context-lengths", "2048", "--shared-prefix", "--steps", "32",
                                         "--json", "{json}"), "tokens_per_s"),
    Case("decode, TP team, TP=2 x DCP=2 (2048 ctx)",
         (sys.executable, os.path.join(HERE, "dcp_decode.py"), "--layouts", "2x1x1@1,2x1x2@1", "--rounds", "1",
          "--out", "{json}"), "tokens_per_s"),
    # the two prefill cases on float32 weights: what a structural change moves there, apart from the int4 kernels
    Case("prefill 2K, one rank, none", (*BENCH, "prefill", "--lengths", "2048", "--layouts", "1x1x1@2", "--repeats",
                                        "1", "--no-ceiling", "--quantization", "none", "--json", "{json}"), "ttft_s"),
    Case("TTFT 4K, PCP=2, none", (*BENCH, "prefill", "--lengths", "4096", "--layouts", "1x2x1@1", "--strategies",
                                  "auto", "--repeats", "1", "--no-ceiling", "--quantization", "none", "--json",
                                  "{json}"), "ttft_s"),
)


def extract(rev: str, folder: str) -> None:
    archive = subprocess.run(["git", "-C", ROOT, "archive", rev, "cpllm"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", folder], input=archive, check=True)


def run_case(case: Case, tree: str, out: str) -> dict[str, float]:
    """Figures of one run, keyed by the result row (layout, batch, context, prompt length)."""
    env = {**os.environ, "PYTHONPATH": tree}
    argv = [out if a == "{json}" else a for a in case.argv]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=os.path.dirname(out))
    if done.returncode != 0:
        raise RuntimeError(f"{case.name} failed on {tree}:\n{done.stderr[-3000:]}")
    with open(out) as f:
        results = json.load(f)["results"]
    figures = {}
    for row in results:
        if row.get("system", "cpllm") != "cpllm":
            continue
        key = " ".join(f"{k}={row[k]}" for k in ("layout", "strategy", "batch_size", "context_tokens", "prompt_tokens")
                       if k in row)
        figures[key] = row[case.metric]
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="git revision of the 'before' side")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cases", default="", help="comma-separated case indices (default: all)")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "structure.json"))
    args = parser.parse_args()
    cases = [CASES[int(i)] for i in args.cases.split(",")] if args.cases else list(CASES)
    runs: dict[tuple[str, str, str], list[float]] = {}
    load_at_start = [round(x, 2) for x in os.getloadavg()]
    with tempfile.TemporaryDirectory() as tmp:
        before = os.path.join(tmp, "before")
        os.makedirs(before)
        extract(args.before, before)
        for r in range(args.rounds):
            for case in cases:
                sides = [("before", before), ("after", ROOT)]
                for side, tree in sides if r % 2 == 0 else sides[::-1]:
                    figures = run_case(case, tree, os.path.join(tmp, "out.json"))
                    for key, value in figures.items():
                        runs.setdefault((case.name, key, side), []).append(value)
                    print(f"round {r} {side} {case.name}: {figures}", flush=True)
    rows = []
    for (name, key, side), values in runs.items():
        if side != "before":
            continue
        before_median = statistics.median(values)
        after_median = statistics.median(runs[(name, key, "after")])
        metric = next(c.metric for c in CASES if c.name == name)
        rows.append({"case": name, "point": key, "metric": metric, "before": before_median, "after": after_median,
                     "ratio": round(after_median / before_median, 3), "before_all": values,
                     "after_all": runs[(name, key, "after")]})
    head = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    with open(args.out, "w") as f:
        json.dump({"argv": ["python", *sys.argv], "before": args.before, "after": head.stdout.strip() + " (working tree)", "rounds": args.rounds,
                   "machine": {**machine_info(), "load_average_start": load_at_start}, "rows": rows}, f, indent=1)
    for row in rows:
        print(f"| {row['case']} | {row['point']} | {row['metric']} | {row['before']} | {row['after']} | "
              f"{row['ratio']} |")


if __name__ == "__main__":
    main()
