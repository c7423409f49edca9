"""Launch paths and failure handling of the multi-process runtime (real processes on gloo)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest

from cpllm import LLM, SamplingParams
from cpllm.distributed.launch import find_free_port
from tiny_models import save_tiny_hf_model

PROMPTS = [[3 + i for i in range(n)] for n in (1, 4, 9, 17, 30, 6, 11)]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_hf_model(str(tmp_path_factory.mktemp("tiny")), "llama", seed=3)


def generate(folder, **layout):
    with LLM(folder, max_model_len=256, block_size=4, threads_per_rank=1, distributed_timeout=60, **layout) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def reference(folder) -> list[list[int]]:
    """The single-rank engine's greedy tokens for PROMPTS, which every layout here must reproduce."""
    return generate(folder)


@pytest.mark.timeout(300)
def test_data_parallel_returns_every_request_once_and_identical(folder, reference):
    with LLM(folder, max_model_len=256, block_size=4, threads_per_rank=1, distributed_timeout=60,
             data_parallel_size=2) as llm:
        ids = [str(i) for i in range(len(PROMPTS))]
        for request_id, prompt in zip(ids, PROMPTS):
            llm.engine.add_request(request_id, prompt, GREEDY)
        finished = []
        while llm.engine.has_unfinished_requests():
            finished += [o for o in llm.engine.step() if o.finished]
    assert sorted(o.request_id for o in finished) == sorted(ids)  # each exactly once
    by_id = {o.request_id: o.outputs[0].token_ids for o in finished}
    assert [by_id[i] for i in ids] == reference


def _cli(folder: str) -> list[str]:
    return ["-m", "cpllm", "generate", "--model", folder, "--prompt", "hello world the cat sat on the mat",
            "--max-tokens", "8", "--ignore-eos", "--max-model-len", "256", "--kv-cache-memory-bytes", "1MiB",
            "--distributed-timeout", "60"]


def _completion(stdout: str) -> str:
    return stdout.split("\n---\n")[0]


@pytest.mark.timeout(300)
def test_torchrun_two_nodes_on_loopback_matches_one_process(folder):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    single = subprocess.run([sys.executable, *_cli(folder)], capture_output=True, text=True, timeout=120, env=env)
    assert single.returncode == 0, single.stderr
    port = find_free_port()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"]
    nodes = [subprocess.Popen([*torchrun, *_cli(folder), "-pcp", "2"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    results = [node.communicate(timeout=240) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], [err[-2000:] for _, err in results]
    printed = [out for out, _ in results if "---" in out]
    assert len(printed) == 1, "exactly one process (global rank 0) prints the result"
    assert _completion(printed[0]) == _completion(single.stdout)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.timeout(180)
def test_killed_worker_fails_the_driver_with_its_rank(folder):
    timeout_s = 10
    llm = LLM(folder, max_model_len=256, block_size=4, threads_per_rank=1, distributed_timeout=timeout_s,
              prefill_context_parallel_size=2)
    pids = dict(llm.engine.executor.workers.pids)
    assert generate_ok(llm)
    os.kill(pids[1], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="worker rank 1"):
        generate_ok(llm)
    assert time.monotonic() - start < timeout_s + 5
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids.values())


def generate_ok(llm) -> bool:
    outputs = llm.generate([{"prompt_token_ids": PROMPTS[3]}], GREEDY)
    return len(outputs[0].outputs[0].token_ids) == GREEDY.max_tokens


IDLE_TIMEOUT_S = 20.0


@pytest.mark.timeout(300)
def test_engine_idle_longer_than_the_collective_timeout_still_serves(folder, reference):
    """Workers wait for the next step, and replica drivers for the next DP tick, with no time limit: an engine
    left idle longer than --distributed-timeout answers the next request (it used to lose its workers).

    Both transports at once ("auto": shared memory; "gloo"), so that they idle through the same wait."""
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    with contextlib.ExitStack() as stack:
        engines = {transport: stack.enter_context(
            LLM(folder, max_model_len=256, block_size=4, threads_per_rank=1, distributed_timeout=IDLE_TIMEOUT_S,
                data_parallel_size=2, prefill_context_parallel_size=2, collective_transport=transport))
            for transport in ("auto", "gloo")}
        first = {t: [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] for t, llm in engines.items()}
        time.sleep(IDLE_TIMEOUT_S + 3)
        second = {t: [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] for t, llm in engines.items()}
    assert first == second == {"auto": reference, "gloo": reference}
