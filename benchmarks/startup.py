"""Start-up time of the two first commands a user runs, against the import they cannot avoid, in one run.

    python benchmarks/startup.py --rounds 3 --out benchmarks/results/startup.json [--before ef50ece]

Per round, each measured in a fresh process, the embedded SmolLM2 GGUF:
- `import`: `python -c "import cpllm, torch, transformers"` (the floor);
- `generate, cold`: `cpllm generate --prompt ... --max-tokens 8` with an empty tokenizer cache (the first run on a
  machine: the GGUF's tokenizer is converted and stored);
- `generate, warm`: the same again (the tokenizer comes from the cache);
- `serve, healthy`: `cpllm serve` until `GET /health` answers 200.
A figure is the median wall time over the rounds; each is also given as a multiple of the import's median. With
`--before REV` the same commands run for that commit's `cpllm/` (git archive, first on PYTHONPATH) in the same
rounds, the two sides taking turns.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

from cpllm.bench.common import machine_info

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GENERATE = [sys.executable, "-m", "cpllm", "generate", "--prompt", "The capital of France is", "--max-tokens", "8"]
IMPORT = [sys.executable, "-c", "import cpllm, torch, transformers"]


NEUTRAL_CWD = tempfile.gettempdir()
"""Where the commands run: not the checkout, whose cpllm/ would come first on sys.path (`python -m`, `-c`) and
shadow the older commit's on PYTHONPATH."""


def timed(argv: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, env=env, check=True, capture_output=True, cwd=NEUTRAL_CWD)
    return time.perf_counter() - start


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_until_healthy(env: dict[str, str], limit_s: float = 120.0) -> float:
    port = free_port()
    start = time.perf_counter()
    server = subprocess.Popen([sys.executable, "-m", "cpllm", "serve", "--port", str(port)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=NEUTRAL_CWD)
    try:
        while time.perf_counter() - start < limit_s:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as answer:
                    if answer.status == 200:
                        return time.perf_counter() - start
            except OSError:
                time.sleep(0.05)
            if server.poll() is not None:
                raise RuntimeError(f"cpllm serve exited with {server.returncode} before it was healthy")
        raise RuntimeError(f"cpllm serve not healthy within {limit_s} s")
    finally:
        server.terminate()
        server.wait(timeout=60)


def one_round(tree: str | None) -> dict[str, float]:
    cache = tempfile.mkdtemp(prefix="cpllm-startup-tokenizers-")
    env = {**os.environ, "CPLLM_TOKENIZER_CACHE": cache}
    if tree is not None:
        env["PYTHONPATH"] = tree
    try:
        return {"import": timed(IMPORT, env), "generate, cold": timed(GENERATE, env),
                "generate, warm": timed(GENERATE, env), "serve, healthy": serve_until_healthy(env)}
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def extract(rev: str) -> str:
    folder = tempfile.mkdtemp(prefix="cpllm-before-")
    archive = subprocess.run(["git", "-C", ROOT, "archive", rev, "cpllm"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", folder], input=archive, check=True)
    return folder


def summary(rounds: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    medians = {name: statistics.median(r[name] for r in rounds) for name in rounds[0]}
    return {name: {"median_s": round(value, 3), "x_import": round(value / medians["import"], 2),
                   "all_s": [round(r[name], 3) for r in rounds]} for name, value in medians.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--before", help="an older commit to measure in the same rounds")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "startup.json"))
    args = parser.parse_args()
    sides = {"after": None} if args.before is None else {"before": extract(args.before), "after": None}
    runs: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
    for index in range(args.rounds):
        order = list(sides) if index % 2 == 0 else list(reversed(sides))
        for side in order:
            runs[side].append(one_round(sides[side]))
            print(side, index, runs[side][-1], flush=True)
    result = {"argv": ["python", "benchmarks/startup.py", *sys.argv[1:]], "machine": machine_info(),
              "rounds": args.rounds, "before": args.before,
              "sides": {side: summary(r) for side, r in runs.items()}}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result["sides"], indent=1))


if __name__ == "__main__":
    main()
