"""The default path (`auto`: the GGUF's int4 weights) before and after the AVX2 int4 kernel, in one run, alternating.

    python benchmarks/int4_before_after.py --before 94865ab --after HEAD --rounds 2 \
        --out benchmarks/results/int4_avx2.json

Each side's `cpllm/` and `benchmarks/` are extracted with `git archive` (`--after` defaults to the working tree)
and each round runs that side's benchmarks/compare.py in its own process: prefill at 2K tokens and decode at
batch 1 and 16 (context 128) of cpllm `auto` and `none` and transformers float32, one thread each. The sides take
turns going first. A figure is the median over the rounds of a side; `ratio` is the after/before ratio of the
rounds' medians, and `vs_none` each side's `auto` against its own `none` measured in the same process. After the
rounds, each side's benchmarks/quality.py gives the greedy agreement of `auto` with `none`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cpllm.bench.common import machine_info  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def cpu_flags() -> list[str]:
    """The flags of this CPU that the int4 kernel choice reads, as /proc/cpuinfo lists them."""
    from report_int4 import CPU_FLAGS

    with open("/proc/cpuinfo") as f:
        flags = set(next((line for line in f if line.startswith("flags")), ":").split(":", 1)[1].split())
    return [flag for flag in CPU_FLAGS if flag in flags]


def extract(rev: str, folder: str) -> None:
    os.makedirs(folder, exist_ok=True)
    archive = subprocess.run(["git", "-C", ROOT, "archive", rev, "cpllm", "benchmarks"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", folder], input=archive, check=True)


def run_json(tree: str, argv: list[str], out: str, what: str) -> dict:
    """The JSON that `argv`, run with `tree`'s cpllm and from `tree`, writes to `out`."""
    done = subprocess.run(argv, env={**os.environ, "PYTHONPATH": tree}, cwd=tree, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed in {tree}:\n{done.stderr[-3000:]}")
    with open(out) as f:
        return json.load(f)


def pcp_efficiency(tree: str, length: int, out: str) -> dict[str, float]:
    """{"cpllm (auto) PCP=2 efficiency <length>": TTFT(1 rank) / (2 TTFT(PCP=2)), and both TTFTs} of that side's
    `cpllm bench prefill` on the default weights, one thread per rank, auto strategy."""
    argv = [sys.executable, "-m", "cpllm", "bench", "prefill", "-q", "auto", "--lengths", str(length),
            "--layouts", "1x1x1@1,1x2x1@1", "--strategies", "auto", "--repeats", "1", "--no-ceiling",
            "--json", out]
    data = run_json(tree, argv, out, "bench prefill")
    rows = [row for value in data.values() if isinstance(value, list) for row in value
            if isinstance(row, dict) and "layout" in row and "ttft_s" in row]
    ttft = {row["layout"].split("@")[0].split("-")[0]: row["ttft_s"] for row in rows}
    return {f"cpllm (auto) TTFT {length} one rank": ttft["1x1x1"], f"cpllm (auto) TTFT {length} PCP=2": ttft["1x2x1"],
            f"cpllm (auto) PCP=2 efficiency {length}": round(ttft["1x1x1"] / (2 * ttft["1x2x1"]), 3)}


def run_side(tree: str, threads: int, out: str, lengths: str = "2048") -> dict[str, float]:
    """{"<system> <what>": tokens/s} of one compare.py run in `tree`."""
    argv = [sys.executable, os.path.join(tree, "benchmarks", "compare.py"), "--lengths", lengths,
            "--threads", str(threads), "--prefill-repeats", "1", "--decode-contexts", "128", "--decode-batches", "1,16",
            "--decode-threads", str(threads), "--decode-steps", "16", "--skip", "llama.cpp", "--no-compiled",
            "--out", out]
    data = run_json(tree, argv, out, "compare.py")
    figures = {f"{row['system']} prefill {row['prompt_tokens']}": row["tokens_per_s"] for row in data["prefill"]}
    figures.update({f"{row['system']} decode batch {row['batch_size']}": row["tokens_per_s"] for row in data["decode"]})
    return figures


def agreement(tree: str, out: str) -> dict:
    """The `auto` rows of that side's quality.py (greedy agreement with `none`)."""
    argv = [sys.executable, os.path.join(tree, "benchmarks", "quality.py"), "--threads", "1", "--out", out]
    done = subprocess.run(argv, env={**os.environ, "PYTHONPATH": tree}, cwd=tree, capture_output=True, text=True)
    if done.returncode != 0:
        return {"error": done.stderr[-2000:]}
    with open(out) as f:
        return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="git revision of the 'before' side")
    parser.add_argument("--after", default=None, help="git revision of the 'after' side (default: working tree)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-quality", action="store_true")
    parser.add_argument("--lengths", default="2048", help="prefill lengths of compare.py, comma-separated")
    parser.add_argument("--pcp-length", type=int, default=0,
                        help="also PCP=2 prefill efficiency at this many tokens on the default weights (0: off)")
    parser.add_argument("--first", choices=("before", "after"), default="before", help="the side of round 0")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "int4_avx2.json"))
    args = parser.parse_args()
    load_at_start = [round(x, 2) for x in os.getloadavg()]
    runs: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"before": os.path.join(tmp, "before"), "after": ROOT}
        extract(args.before, trees["before"])
        if args.after:
            trees["after"] = os.path.join(tmp, "after")
            extract(args.after, trees["after"])
        for r in range(args.rounds):
            order = ("before", "after") if args.first == "before" else ("after", "before")
            for side in order if r % 2 == 0 else order[::-1]:
                figures = run_side(trees[side], args.threads, os.path.join(tmp, "out.json"), args.lengths)
                if args.pcp_length:
                    figures.update(pcp_efficiency(trees[side], args.pcp_length, os.path.join(tmp, "pcp.json")))
                for key, value in figures.items():
                    runs.setdefault((key, side), []).append(value)
                print(f"round {r} {side}: {figures}", flush=True)
        quality = {} if args.no_quality else {
            side: agreement(tree, os.path.join(tmp, f"quality_{side}.json")) for side, tree in trees.items()}
    write_summary(args, runs, quality, load_at_start)


def write_summary(args, runs: dict[tuple[str, str], list[float]], quality: dict, load_at_start: list[float]) -> None:
    """The medians of each figure and side, their ratios, and auto against none of the same side, to args.out."""
    medians = {key: round(statistics.median(values), 4) for key, values in runs.items()}
    rows = []
    for key in sorted({k for k, _ in runs}):
        before, after = medians.get((key, "before")), medians.get((key, "after"))
        none_key = key.replace("cpllm (auto)", "cpllm")
        none = {side: medians.get((none_key, side)) if none_key != key else None for side in ("before", "after")}
        rows.append({"figure": key, "before": before, "after": after,
                     "ratio": round(after / before, 2) if before and after else None,
                     "before_vs_none": round(before / none["before"], 2) if none["before"] else None,
                     "after_vs_none": round(after / none["after"], 2) if none["after"] else None,
                     "before_all": runs.get((key, "before")), "after_all": runs.get((key, "after"))})
    with open(args.out, "w") as f:
        json.dump({"command": "int4_before_after", "argv": sys.argv[1:], "before": args.before,
                   "after": args.after or "working tree", "rounds": args.rounds, "threads": args.threads,
                   "machine": {**machine_info(), "cpu_flags": cpu_flags(), "load_average_start": load_at_start,
                               "load_average_end": [round(x, 2) for x in os.getloadavg()]},
                   "rows": rows, "quality": quality}, f, indent=1)
    for row in rows:
        print(f"| {row['figure']} | {row['before']} | {row['after']} | {row['ratio']} | {row['before_vs_none']} | "
              f"{row['after_vs_none']} |")


if __name__ == "__main__":
    main()
