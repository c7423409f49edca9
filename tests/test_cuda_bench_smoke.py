"""benchmarks/cuda_decode.py --smoke: every figure of issue 28's targets is measured and written, on tiny shapes on
the CPU (the numbers are not checked, only that each measurement ran and the JSON holds each figure)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPECTED = ("bound/hbm_bandwidth", "bound/matmul_rate", "decode_b1_smoke_ctx32/fraction_of_bound",
            "decode_b1_smoke_ctx64/vs_hf_static", "decode_b1_smoke_ctx64/graphs_same_tokens",
            "ttft_smoke_ctx64/fraction_of_matmul_rate", "ttft_smoke_ctx64/vs_hf_sdpa",
            "decode_b3_smoke_ctx16/vs_hf_static")


def test_cuda_decode_benchmark_smoke(tmp_path):
    out = tmp_path / "figures.json"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=REPO)
    done = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "cuda_decode.py"), "--smoke", "--out",
                           str(out), "--cache", str(tmp_path / "models")], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(out.read_text())["figures"]
    assert all(name in figures and math.isfinite(figures[name]["value"]) for name in EXPECTED), sorted(figures)
    assert figures["decode_b1_smoke_ctx64/graphs_same_tokens"]["value"] == 1.0  # on the CPU both runs are eager
    assert sum(line.startswith("FIGURE ") for line in done.stdout.splitlines()) == len(figures)
