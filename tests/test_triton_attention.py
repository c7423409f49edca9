"""The Triton attention kernels (cpllm/kernels/triton_attention.py, triton_prefill.py) and the gqa-triton backend,
run on the CPU by Triton's interpreter against float64 attention, plus the choice of backend per device.

The interpreter is switched on by TRITON_INTERPRET=1 before triton is imported, so the kernel cases run in a child
process (tests/triton_interpret_cases.py); this process never imports triton with it set. triton comes from the
`triton` extra (scripts/setup.sh installs it); without it those cases are skipped, saying so.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from cpllm.layers.gqa_triton import backend as triton_backend
from cpllm.layers.registry import attention_backend
from cpllm.layers.gqa_triton import choice
from cpllm.layers.gqa_triton.backend import TritonPagedBackend
from cpllm.layers.gqa_triton.choice import kind_for
from cpllm.kernels import triton_attention
from cpllm.kernels.triton_attention import paged_decode_attention, split_count
from cpllm.kernels.triton_prefill import prefill_attention

TESTS = os.path.dirname(os.path.abspath(__file__))
HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed: pip install -e '.[triton]' "
                                  "(scripts/setup.sh does) to run the Triton kernels under the interpreter")


@pytest.fixture(scope="module")
def interpreted():
    """{group: {case: [error, tol] or traceback}} from one child process per group."""
    results = {}

    def run(group: str) -> dict:
        if group not in results:
            env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.path.dirname(TESTS))
            done = subprocess.run([sys.executable, os.path.join(TESTS, "triton_interpret_cases.py"), group],
                                  cwd=TESTS, env=env, capture_output=True, text=True, timeout=600)
            assert done.returncode == 0, done.stderr[-3000:]
            results[group] = json.loads(done.stdout.strip().splitlines()[-1])
        return results[group]
    return run


def _assert_cases(cases: dict, expected: int) -> None:
    assert len(cases) == expected, sorted(cases)
    failed = {name: got for name, got in cases.items() if isinstance(got, str) or not got[0] <= got[1]}
    assert not failed, "\n".join(f"{name}: {got}" for name, got in failed.items())


@needs_triton
def test_decode_kernel_matches_float64_attention(interpreted):
    """Pool dtypes f32 / bf16 / f16 (and a float32 query over a bf16 pool), head sizes 8-256 (96: masked lanes),
    GQA groups 1-8, lengths 0 / 1 / off the key block, one split or several, slots padded past each length with
    slot numbers outside the pool (never read)."""
    _assert_cases(interpreted("decode"), 9)


@needs_triton
def test_prefill_kernel_matches_float64_attention(interpreted):
    """A chunk against its context read through the slot table plus its own keys causally, over several query
    blocks; no context; context only; keys given as a tensor (the protocol's plain `attend`)."""
    _assert_cases(interpreted("prefill"), 8)


@needs_triton
def test_cp_layer_with_the_triton_backend_matches_the_gqa_backend(interpreted):
    """PagedCPAttention with gqa-triton: prefill with context, one-shard decode, decode with lse, bf16 pools and a
    sliding window give the GQA backend's outputs, and the kernels served the calls."""
    _assert_cases(interpreted("layer"), 5)


@needs_triton
def test_cp_layouts_with_the_triton_backend_match_float64(interpreted):
    """scripts/gpu_check.py's CP layouts (PCP 2/4 by all-gather and ring, DCP 2, PCP 2 x DCP 2; fp32 and bf16;
    prefill with context and decodes sharing a prefix) with gqa-triton, each rank's kernels under the interpreter:
    within the CP layer's tolerance of float64, every KV write where it belongs."""
    _assert_cases(interpreted("cp"), 24)


@needs_triton
def test_kernels_compile_for_nvidia_targets_without_a_gpu():
    """triton's CUDA backend compiles the kernels for sm_80 and sm_90 here (PTX, then its bundled ptxas): what the
    interpreter cannot check (loop-bound and integer-width typing, tl.dot shapes, shared memory per block)."""
    env = dict(os.environ, PYTHONPATH=os.path.dirname(TESTS))
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, os.path.join(TESTS, "triton_aot_cases.py")], cwd=TESTS, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    cases = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(cases) == 8 and all(v.startswith("ok") for v in cases.values()), cases


def test_registry_and_interface():
    assert isinstance(attention_backend("gqa-triton"), TritonPagedBackend) and attention_backend("gqa-triton").name == \
        "gqa-triton"
    gqa = attention_backend("gqa")
    missing = [name for name in dir(type(gqa)) if not name.startswith("_") and not hasattr(TritonPagedBackend, name)]
    assert not missing


def test_kind_is_chosen_per_device(monkeypatch):
    monkeypatch.setattr(triton_attention, "available", lambda: True)
    assert kind_for("gqa", "cuda") == "gqa-triton" and kind_for("gqa", "cpu") == "gqa"
    assert kind_for("mla", "cuda") == "mla"  # only the GQA kind has Triton kernels
    with torch.device("meta"):
        assert kind_for("gqa") == "gqa"  # the default device, as a runner sets it while it builds the model
    monkeypatch.setenv(choice.ENV_SWITCH, "0")
    assert kind_for("gqa", "cuda") == "gqa"
    monkeypatch.delenv(choice.ENV_SWITCH)
    monkeypatch.setattr(triton_attention, "available", lambda: False)
    assert kind_for("gqa", "cuda") == "gqa"  # no triton: the SDPA path stays


def test_cpu_tensors_without_the_interpreter_take_the_gqa_path(monkeypatch):
    """On the CPU outside the interpreter the backend is the GQA one (the C kernels), bit for bit."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(5, 4, 8, generator=g), torch.randn(9, 2, 8, generator=g), torch.randn(9, 2, 8, generator=g)
    got = TritonPagedBackend.attend(q, k, v, 0.3, False)
    want = attention_backend("gqa").attend(q, k, v, 0.3, False)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    keys, _ = TritonPagedBackend.context_keys(k, v, torch.tensor([3, 1]), torch.float32)
    assert isinstance(keys, torch.Tensor) and torch.equal(keys, k[[3, 1]])


def test_split_count_fills_the_gpu_and_keeps_splits_long():
    assert split_count(1, 8, 32768) == 33  # 264 programs wanted over 8 KV heads, 128 splits possible
    assert split_count(64, 8, 32768) == 1  # 512 programs already
    assert split_count(1, 8, 300) == 2  # at least MIN_SPLIT positions each
    assert split_count(1, 1, 10**6) == triton_attention.MAX_SPLITS


def test_bad_shapes_are_refused_before_any_kernel():
    q, pool = torch.zeros(2, 4, 8), torch.zeros(10, 2, 8)
    slots, lengths = torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        paged_decode_attention(torch.zeros(2, 3, 8), pool, pool, slots, lengths, 1.0)
    with pytest.raises(ValueError, match="batch of 2"):
        paged_decode_attention(q, pool, pool, slots[:1], lengths, 1.0)
    with pytest.raises(ValueError, match="reads pools of"):
        paged_decode_attention(q, pool.int(), pool.int(), slots, lengths, 1.0)
    with pytest.raises(ValueError, match="new keys"):
        prefill_attention(torch.zeros(3, 4, 8), pool, pool, 1.0, new_k=torch.zeros(2, 2, 8),
                          new_v=torch.zeros(2, 2, 8))
