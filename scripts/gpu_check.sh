#!/usr/bin/env bash
# Device-path check of cpllm: the single-rank engine (fp32, bf16) and the CP attention layer on CUDA, against
# transformers, a float64 reference and the CPU engine; on CUDA also the Triton kernels, the CP layer on the
# gqa-triton backend and the engine with CUDA graphs on and off (--enforce-eager). One line per check, "PASS name
# detail" / "FAIL name detail"; the exit status is non-zero when any check fails. Then benchmarks/cuda_decode.py
# prints issue 28's figures ("FIGURE name value unit (target ...)"), which are reported, not checked. Bounded at
# 8 minutes on one GPU (checks 80 + 150 s, figures 230 s).
#
#   bash scripts/gpu_check.sh          # on a machine with a GPU: the CPU checks, then the CUDA checks
#   bash scripts/gpu_check.sh --cpu    # the same checks on the CPU only (tests/test_device_path.py runs this)
#
# Python: .venv/bin/python when it exists; else a python3 that already imports torch (a GPU machine's image
# brings its own CUDA build of torch: it is used as it is, never replaced by the CPU build that setup.sh pins);
# else `bash scripts/setup.sh` creates .venv. The repository is put on PYTHONPATH, so cpllm needs no install.
# Missing pure-Python dependencies are installed with pip (pinned as in pyproject.toml) where a registry is
# reachable; gguf, which only the GGUF writers of tests/tiny_models.py use, is replaced by an inert stand-in
# when absent. Wheels in .whl/ (carried to an offline machine) are installed first, without an index.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if [ -x .venv/bin/python ]; then
  PY=.venv/bin/python
elif python3 -c "import torch" 2>/dev/null; then
  PY=python3
else
  echo "# no .venv and no torch for python3: bash scripts/setup.sh (installs torch==2.13.0 into .venv)"
  bash scripts/setup.sh || { echo "FAIL setup scripts/setup.sh failed"; exit 1; }
  PY=.venv/bin/python
fi

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/gpu_check_site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/gpu_check_site"
fi
declare -A PINS=([transformers]=5.24.0 [tokenizers]=0.23.3 [safetensors]=0.8.0 [numpy]=2.4.6 [jinja2]=3.1.6
                 [triton]=3.9.0)
modules="transformers tokenizers safetensors numpy jinja2"
[ "${1:-}" = "--cpu" ] || modules="$modules triton"  # a CUDA build of torch brings its own triton, used as it is
for module in $modules; do
  if ! "$PY" -c "import $module" 2>/dev/null; then
    echo "# $module is missing: pip install $module==${PINS[$module]}"
    if ! "$PY" -m pip install -q "$module==${PINS[$module]}"; then
      # without triton the rest still runs: the engine takes the SDPA path, and each Triton check FAILs by name
      [ "$module" = triton ] && { echo "# triton cannot be installed: the Triton checks will fail"; continue; }
      echo "FAIL setup cannot install $module"; exit 1
    fi
  fi
done

status=0
if [ "${1:-}" = "--cpu" ]; then
  timeout 400 "$PY" scripts/gpu_check.py --cpu || status=1
else
  dump="$(mktemp -d)/cpu_engine.json"
  # The CPU engine's outputs are the reference the CUDA engine is compared with (--compare).
  timeout 80 "$PY" scripts/gpu_check.py --cpu --dump "$dump" || status=1
  timeout 150 "$PY" scripts/gpu_check.py --compare "$dump" || status=1
  # issue 28's figures (reported, not checked): bounds, 1B batch-1 decode graphs/eager vs HBM bound and
  # transformers, TTFT 8K/32K vs the matmul rate, batch-64 decode of the 8B shape (8 of its 32 layers)
  timeout 230 "$PY" benchmarks/cuda_decode.py --out "$(dirname "$dump")/cuda_figures.json" \
    || echo "# figures: benchmarks/cuda_decode.py did not complete (timeout or error)"
fi
if [ "$status" -ne 0 ]; then
  echo "# gpu_check: FAILED"
else
  echo "# gpu_check: all checks passed"
fi
exit "$status"
