"""Run vLLM's own OpenAI-server tests against `cpllm serve`, unchanged, from a vLLM checkout (or sdist).

    .venv/bin/python benchmarks/vllm_server_suite.py /path/to/vllm [--dirs chat_completion completion basic]
        [--model PATH] [--out DIR] [-k EXPR]

Runs pytest in the checkout on tests/entrypoints/openai/<dir> for each dir there, with the shim plugin
(benchmarks/vllm_server_shim.py): vLLM's test server becomes `cpllm serve` on SmolLM2 (or --model), vLLM's own
modules are stubs, and a test that uses them is skipped. conftest files above tests/entrypoints (which import all
of vLLM) are not loaded. Needs pytest-asyncio and pybase64 in the venv (pip install pytest-asyncio pybase64), not
vLLM. Writes DIR/junit.xml, DIR/summary.json (counts, and each failure with its first line) and
DIR/dropped_flags.json (the vLLM flags cpllm does not take, per model), and prints the counts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
DIRS = ("chat_completion", "completion", "basic")


def run_suite(checkout: Path, dirs: list[str], out: Path, model: str | None, select: str | None,
              timeout_s: int) -> int:
    targets = [f"tests/entrypoints/openai/{d}" for d in dirs if (checkout / "tests/entrypoints/openai" / d).is_dir()]
    if not targets:
        raise SystemExit(f"none of {dirs} is under {checkout}/tests/entrypoints/openai")
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")]),
           "CPLLM_SUITE_LOG": str(out), "CPLLM_SUITE_MODEL": model or "",
           "HF_HUB_OFFLINE": "1"}  # a test that loads a tokenizer from the hub fails at once instead of retrying
    command = [sys.executable, "-m", "pytest", *targets, "-p", "vllm_server_shim", "-p", "no:cacheprovider", "--continue-on-collection-errors",
               "--confcutdir", str(checkout / "tests/entrypoints"), f"--junitxml={out / 'junit.xml'}", "-q",
               "-rfEs", f"--timeout={timeout_s}"]
    if select:
        command += ["-k", select]
    print("running:", " ".join(command), flush=True)
    return subprocess.run(command, cwd=checkout, env=env).returncode


def summarize(out: Path) -> dict:
    """Counts and failures from the junit file (collection errors count as errors, by module)."""
    root = ET.parse(out / "junit.xml").getroot()
    counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
    failures = []
    for case in root.iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        outcome = next((child for child in case if child.tag in ("failure", "error", "skipped")), None)
        if outcome is None:
            counts["passed"] += 1
        elif outcome.tag == "skipped":
            counts["skipped"] += 1
        else:
            counts["failed" if outcome.tag == "failure" else "errors"] += 1
            failures.append({"test": name, "kind": outcome.tag,
                             "message": (outcome.get("message") or "").splitlines()[0][:300] if
                             outcome.get("message") else ""})
    summary = {"counts": counts, "failures": failures}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkout", type=Path, help="a vLLM checkout (or unpacked sdist) with tests/")
    parser.add_argument("--dirs", nargs="+", default=list(DIRS), help="folders of tests/entrypoints/openai")
    parser.add_argument("--model", help="the model cpllm serves (default: cpllm's default, SmolLM2-135M-Instruct)")
    parser.add_argument("--out", type=Path, default=Path("vllm-suite-results"), help="where results go")
    parser.add_argument("-k", dest="select", help="pytest -k expression")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per test (pytest-timeout)")
    args = parser.parse_args()
    out = args.out.resolve()
    run_suite(args.checkout.resolve(), args.dirs, out, args.model, args.select, args.timeout)
    summary = summarize(out)
    print(json.dumps(summary["counts"]))


if __name__ == "__main__":
    main()
