"""The decode-step profile of an older commit next to the working tree's, measured in one run, alternating.

    python benchmarks/profile_before_after.py --before e89de9e --out benchmarks/results/decode_profile.json

The older commit's `cpllm/` is extracted with `git archive` into a temporary folder and put first on PYTHONPATH;
each side runs benchmarks/profile_decode.py in its own process, `--pairs` times, before and after taking turns
so that a change in machine load touches both. The profile table kept for each side is that of its fastest run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def extract(rev: str, folder: str) -> None:
    archive = subprocess.run(["git", "-C", ROOT, "archive", rev, "cpllm"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", folder], input=archive, check=True)


def profile(tree: str, args: argparse.Namespace, out: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tree, HERE])}
    command = [sys.executable, os.path.join(HERE, "profile_decode.py"), "--quantization", args.quantization,
               "--batch", str(args.batch), "--context", str(args.context), "--threads", str(args.threads),
               "--steps", str(args.steps), "--top", "12", "--json", out]
    subprocess.run(command, env=env, check=True, capture_output=True)
    with open(out) as f:
        return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="git revision of the 'before' side")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/decode_profile.json")
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as tmp:
        before = os.path.join(tmp, "before")
        os.makedirs(before)
        extract(args.before, before)
        for i in range(args.pairs):
            for side, tree in (("before", before), ("after", ROOT)):
                runs[side].append(profile(tree, args, os.path.join(tmp, f"{side}{i}.json")))
                print(f"{side}: {runs[side][-1]['step_ms']} ms/step", flush=True)
    head = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    sides = {}
    for side, found in runs.items():
        best = min(found, key=lambda r: r["best_step_ms"])
        sides[side] = {"step_ms": [r["step_ms"] for r in found], "best_step_ms": best["best_step_ms"],
                       "aten_calls_per_step": best["aten_calls_per_step"], "ops": best["ops"]}
    payload = {"command": "profile_before_after", "argv": sys.argv[1:], "machine": runs["after"][0]["machine"],
               "before_rev": args.before, "after_rev": f"{head.stdout.strip()} + working tree",
               "workload": {k: getattr(args, k) for k in ("quantization", "batch", "context", "threads", "steps")},
               **sides}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(payload, f, indent=2)


if __name__ == "__main__":
    main()
