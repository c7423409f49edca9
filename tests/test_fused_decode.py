"""Decode steps one C call per layer (cpllm/model/execution/fused_decode.py) against the eager layers they replace.

The fused layer runs the eager path's own C kernels back to back, so on a tiny Llama whose every linear is 4-bit
(run on the VNNI int4 kernel) the engine's outputs must equal, bit for bit, a run with fusing turned off: greedy
tokens, their logprobs and the prompt logprobs, for float32 and float16 K/V, with batches of several requests of
different lengths and a shared prefix (decode-only steps read each request's own slots, fused or eager). With
float32 weights (quantization none) the fused matrix-vector loop sums in another order than MKL: greedy tokens
equal, logprobs within 1e-5 (measured 0 here; 2.2e-5 on SmolLM2 over 120 tokens). Under PCP the ranks run the
fused steps as one decode team (cpllm/model/execution/decode_team.py), for both KV layouts, and under TP (with and without
DCP) the TP ranks do, each on its weight shards; those runs must match the single-rank engine as the other layout
tests do, and a team barrier whose peer never comes must give up. A model the fused layer cannot run (a Q8_0 projection: q|k|v in two kernels),
or kernels turned off, keeps the eager layers.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import random
import signal
import threading
import time

import pytest
from gguf import GGMLQuantizationType as QType

import tiny_models as tm  # tests/ is on sys.path under pytest
from cpllm import LLM, SamplingParams
from cpllm.kernels import int4_matmul, structs
from cpllm.model.execution import decode_team
from cpllm.model.execution import fused_decode
from parallel_helpers import prompt_logprob_values, sampled_logprobs  # tests/ too

pytestmark = pytest.mark.skipif(not int4_matmul.available(), reason="no AVX-512 VNNI int4 kernel on this machine")

FOUR_BIT = {"q_proj": QType.Q4_0, "k_proj": QType.Q4_1, "v_proj": QType.Q4_0, "o_proj": QType.Q4_1,
            "gate_proj": QType.Q4_1, "up_proj": QType.Q4_0, "down_proj": QType.Q4_0, "embed_tokens": QType.Q8_0}
ENGINE = dict(max_model_len=256, block_size=4, threads_per_rank=1)
TEAM_STEPS = dict(max_num_batched_tokens=48)
"""The team tests' steps: at most 48 rows, so the prompts stay on the int4 integer kernel (BF16_MIN_ROWS is 64).
They compare decode teams with one rank; a TP rank's bf16 GEMM partial sums would round the prompts' rows apart
from one rank's by ~3e-3 (the bf16 format's own rounding)."""
two_cores = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2,
                               reason="a decode team of two ranks needs a core for each (DecodeTeam.open)")
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1, prompt_logprobs=1)


def _gguf(tmp_path_factory, name: str, types: dict, **overrides) -> str:
    path = str(tmp_path_factory.mktemp(name) / "tiny.gguf")
    tm.save_tiny_gguf(path, "llama", seed=8, tie_word_embeddings=True,
                      tensor_types=lambda n: next((t for k, t in types.items() if k in n), QType.F32), **overrides)
    return path


@pytest.fixture(scope="module")
def four_bit_gguf(tmp_path_factory) -> str:
    return _gguf(tmp_path_factory, "fourbit", FOUR_BIT)


@pytest.fixture(scope="module")
def one_kv_head_gguf(tmp_path_factory) -> str:
    """One KV head: under TP=2 both ranks hold it, so DCP=2 can shard its cache."""
    return _gguf(tmp_path_factory, "mqa", FOUR_BIT, num_key_value_heads=1)


def _prompts() -> list[dict]:
    rng = random.Random(3)
    prefix = [rng.randrange(3, 300) for _ in range(40)]
    own = [[rng.randrange(3, 300) for _ in range(rng.randrange(2, 30))] for _ in range(6)]
    return [{"prompt_token_ids": ids} for ids in own] + [{"prompt_token_ids": prefix + [5 + i]} for i in range(3)]


def _prompts_for(quantization: str) -> list[dict]:
    """Every prompt: float32 weights run fused up to F32_MAX_ROWS rows, more than the 9 requests."""
    assert len(_prompts()) <= fused_decode.F32_MAX_ROWS
    return _prompts()


def _run(path: str, fused: bool, monkeypatch, **options):
    """(outputs, fused steps) of one engine run; `fused=False` builds no fused layers."""
    with monkeypatch.context() as patch:
        if not fused:
            patch.setattr(fused_decode.FusedDecode, "build", classmethod(lambda cls, model: None))
        with LLM(path, **ENGINE, **options) as llm:
            outputs = llm.generate(_prompts_for(options.get("quantization", "auto")), PARAMS)
            executor = llm.engine.executor
            return outputs, (executor.rank_stats().fused_steps if executor.rank_info.decode.fused else None)


def _values(output) -> tuple:
    return output.outputs[0].token_ids, sampled_logprobs(output), prompt_logprob_values(output)


def _worst_against(outputs, reference) -> float:
    """Greedy tokens equal the reference's (asserted); the worst sampled or prompt logprob difference."""
    worst = 0.0
    for got, want in zip(outputs, reference):
        tokens, sampled, prompt = _values(got)
        want_tokens, want_sampled, want_prompt = _values(want)
        assert tokens == want_tokens
        worst = max([worst, *(abs(a - b) for a, b in zip(sampled + prompt, want_sampled + want_prompt))])
    return worst


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "float16"])
def test_fused_steps_equal_the_eager_layers_bit_for_bit(four_bit_gguf, monkeypatch, kv_cache_dtype):
    fused, fused_steps = _run(four_bit_gguf, True, monkeypatch, kv_cache_dtype=kv_cache_dtype)
    eager, eager_steps = _run(four_bit_gguf, False, monkeypatch, kv_cache_dtype=kv_cache_dtype)
    assert fused_steps and fused_steps > 0 and eager_steps is None
    for got, want in zip(fused, eager):
        assert _values(got) == _values(want)


@two_cores
@pytest.mark.parametrize("layout,quantization", [("sharded", "auto"), ("replicated", "auto"), ("sharded", "none")])
def test_pcp_ranks_decode_as_a_team_and_match_one_rank(four_bit_gguf, monkeypatch, layout, quantization):
    """PCP=2: the ranks run each decode step's fused layers as one team (each a share of every linear's columns and
    of the attention: its KV shard, or its half of a replicated context). Greedy tokens equal one rank's, logprobs
    within 1e-3 (attention parts merge by log-sum-exp in another order, and the prompt's attention is split over
    the ranks; measured up to 8e-5)."""
    one_rank, _ = _run(four_bit_gguf, True, monkeypatch, quantization=quantization, **TEAM_STEPS)
    with LLM(four_bit_gguf, **ENGINE, **TEAM_STEPS, prefill_context_parallel_size=2, cp_kv_cache_layout=layout,
             quantization=quantization, distributed_timeout=60) as llm:
        two_ranks = llm.generate(_prompts_for(quantization), PARAMS)
        decode, steps = llm.engine.executor.rank_info.decode, llm.engine.executor.rank_stats().fused_steps
        assert decode.fused and decode.team is not None and steps >= PARAMS.max_tokens - 1
    worst = _worst_against(two_ranks, one_rank)
    print(f"{layout} PCP=2 team vs one rank ({quantization}): worst logprob difference {worst:.2e}")
    assert worst <= 1e-3


@two_cores
@pytest.mark.parametrize("kv_heads,dcp,quantization,layout", [(2, 1, "auto", "sharded"), (1, 2, "auto", "sharded"),
                                                              (1, 2, "none", "sharded"), (1, 2, "auto", "replicated")])
def test_tp_ranks_decode_as_a_team_and_match_one_rank(four_bit_gguf, one_kv_head_gguf, monkeypatch, kv_heads,
                                                      dcp, quantization, layout):
    """TP=2 (PCP=1): the TP ranks run each decode step's fused layers as one team, each on its weight shards, the
    partial sums of the output and down projections and (DCP=2: each rank holding half of the one KV head's cache)
    the queries and attention parts meeting in shared memory. Greedy tokens equal one rank's, logprobs within 1e-3
    (sums in another order; measured up to 4e-5). With PCP=1 the replicated layout holds the same shards (DCP's)."""
    path = four_bit_gguf if kv_heads == 2 else one_kv_head_gguf
    one_rank, _ = _run(path, True, monkeypatch, quantization=quantization, **TEAM_STEPS)
    with LLM(path, **ENGINE, **TEAM_STEPS, tensor_parallel_size=2, decode_context_parallel_size=dcp,
             quantization=quantization, cp_kv_cache_layout=layout, distributed_timeout=60) as llm:
        two_ranks = llm.generate(_prompts_for(quantization), PARAMS)
        decode, steps = llm.engine.executor.rank_info.decode, llm.engine.executor.rank_stats().fused_steps
        assert decode.fused_tensor_parallel and decode.team is not None and steps >= PARAMS.max_tokens - 1
    worst = _worst_against(two_ranks, one_rank)
    print(f"TP=2 DCP={dcp} team vs one rank ({quantization}): worst logprob difference {worst:.2e}")
    assert worst <= 1e-3


@two_cores
@pytest.mark.timeout(120)
def test_a_member_killed_during_team_decode_fails_the_driver_naming_it(four_bit_gguf):
    """Rank 1 is killed while the team decodes: the driver, waiting in a team barrier or a collective, raises an
    error naming rank 1 within the distributed timeout (the barrier's check notices the exited process)."""
    timeout_s = 10
    llm = LLM(four_bit_gguf, **ENGINE, prefill_context_parallel_size=2, distributed_timeout=timeout_s)
    try:
        assert llm.engine.executor.rank_info.decode.team is not None
        pid = llm.engine.executor.workers.pids[1]
        long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        killer = threading.Timer(0.3, os.kill, (pid, signal.SIGKILL))
        killer.start()
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="worker rank 1"):
            for _ in range(100):  # until the kill lands
                llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 4, long)
        assert time.monotonic() - start < timeout_s + 5
        killer.join()
    finally:
        with contextlib.suppress(RuntimeError):  # the workers are gone already when the test got its error
            llm.shutdown()


def test_a_team_barrier_gives_up_when_its_check_says_so():
    """A member that never arrives: the barrier spins, then calls its check every 50 ms; a check that reports a
    problem (the group's timeout, a dead member: ShmGroup.wait_problem) makes it return -2 instead of waiting on."""
    lib = fused_decode._library()
    mapping = mmap.mmap(-1, 4096)
    spec = decode_team.TeamSpec(ctypes.addressof(ctypes.c_char.from_buffer(mapping)), 0, 0, 0, 0, 0, 1, 0, 2, 0)
    calls = []

    def check(waited_s: float) -> int:
        calls.append(waited_s)
        return int(len(calls) >= 2)

    spec.check = keep = structs.TeamCheck(check)
    started = time.monotonic()
    assert lib.cpllm_team_barrier(ctypes.byref(spec)) == -2
    assert len(calls) == 2 and calls[0] >= 0.05 and calls[1] >= 0.1 and time.monotonic() - started < 5
    flags = (ctypes.c_int64 * 16).from_buffer(mapping)
    assert flags[0] == 1 and flags[decode_team.FLAG_STRIDE] == 0  # published its own arrival, saw none
    flags[decode_team.FLAG_STRIDE] = 2  # the other member is past it: the next barrier does not wait
    assert lib.cpllm_team_barrier(ctypes.byref(spec)) == 0 and len(calls) == 2
    del keep


def test_float_weights_fuse_within_float32_rounding(four_bit_gguf, monkeypatch):
    fused, fused_steps = _run(four_bit_gguf, True, monkeypatch, quantization="none")
    eager, _ = _run(four_bit_gguf, False, monkeypatch, quantization="none")
    assert fused_steps and fused_steps > 0
    worst = 0.0
    for got, want in zip(fused, eager):
        tokens, sampled, prompt = _values(got)
        want_tokens, want_sampled, want_prompt = _values(want)
        assert tokens == want_tokens and prompt == want_prompt  # prompts run eager either way
        worst = max([worst, *(abs(a - b) for a, b in zip(sampled, want_sampled))])
    print(f"float32 fused vs eager: worst sampled logprob difference {worst:.2e}")
    assert worst <= 1e-5


def test_float_weights_leave_batches_over_sixteen_rows_to_the_eager_layers(four_bit_gguf):
    """f32_matmul.c streams the weights once per 16 rows: bigger float32 batches run eager (MKL reads them once)."""
    with LLM(four_bit_gguf, **ENGINE, quantization="none") as llm:
        assert llm.engine.executor.rank_info.decode.fused_max_rows == fused_decode.F32_MAX_ROWS
        prompts = [{"prompt_token_ids": [3 + i, 40, 7 + i]} for i in range(fused_decode.F32_MAX_ROWS + 1)]
        outputs = llm.generate(prompts, PARAMS)
        assert all(len(o.outputs[0].token_ids) == PARAMS.max_tokens for o in outputs)
        assert llm.engine.executor.rank_stats().fused_steps == 0


def test_layers_the_fused_call_cannot_run_stay_eager(tmp_path_factory, monkeypatch):
    path = _gguf(tmp_path_factory, "mixed", {**FOUR_BIT, "v_proj": QType.Q8_0})  # q|k|v in two kernels
    with LLM(path, **ENGINE) as llm:
        assert not llm.engine.executor.rank_info.decode.fused
        assert llm.generate(_prompts()[:2], PARAMS)[0].outputs[0].token_ids
    monkeypatch.setenv("CPLLM_KERNELS", "0")
    with LLM(path, **ENGINE, quantization="none") as llm:
        assert not llm.engine.executor.rank_info.decode.fused
