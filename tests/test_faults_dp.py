"""Isolated data-parallel replicas under faults, on real processes over loopback (`cpllm serve -dp 2`).

Each replica is its own process (here a single rank); the tests kill or stop one and count every request: each
ends complete or with an error event naming the failure, none is lost or answered twice, the other replica keeps
serving, and the failed one comes back and takes requests again.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import psutil
import pytest
from test_faults import LONG_FLAGS, health, metrics, total, wait_for
from tiny_models import save_tiny_hf_model

from cpllm.server.process import ServerProcess

DEADLINE_S = 5.0
DP2 = [*LONG_FLAGS, "-dp", "2", "--threads-per-rank", "1", "--distributed-timeout", str(DEADLINE_S),
       "--max-num-seqs", "2", "--kv-cache-memory-bytes", "96MiB"]
"""The last --kv-cache-memory-bytes wins: two 3,000-token requests of the model below fit a replica's pool."""


@pytest.fixture(scope="module")
def long_model(tmp_path_factory) -> str:
    # wide and deep enough that a 3,000-token request runs for seconds on an idle machine (the 2-layer, 64-wide
    # tiny model finishes one in about 1.5 s, before the test has looked at the metrics)
    return save_tiny_hf_model(str(tmp_path_factory.mktemp("tiny_faults_dp")), max_position_embeddings=4096,
                              hidden_size=256, intermediate_size=1024, num_hidden_layers=8)


def replica_pids(server: ServerProcess) -> dict[int, int]:
    """Replica index -> pid of its driver process (the server's direct children)."""
    found = {}
    for proc in psutil.Process(server.process.pid).children():
        try:
            cmd = proc.cmdline()
        except psutil.Error:
            continue
        if "cpllm.distributed.rank_entry" in cmd and proc.status() != psutil.STATUS_ZOMBIE:
            found[int(cmd[cmd.index("cpllm.distributed.rank_entry") + 1])] = proc.pid
    return found


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


class Outcome:
    """How one request ended, as its client saw it."""

    def __init__(self):
        self.lock = threading.Lock()
        self.complete: list[str] = []
        self.errors: list[str] = []
        self.problems: list[str] = []
        self.ids: list[str] = []

    def add(self, kind: str, value: str) -> None:
        with self.lock:
            getattr(self, kind).append(value)


def sse_lines(response: httpx.Response):
    """The stream's lines split at newlines only, as SSE and the openai client split them (httpx's iter_lines also
    splits at U+2028, U+0085 and the like, which a random model's text may hold inside a JSON string)."""
    buffer = ""
    for text in response.iter_text():
        *lines, buffer = (buffer + text).split("\n")
        yield from (line.rstrip("\r") for line in lines)
    if buffer:
        yield buffer


REQUEST_TIMEOUT_S = 240
"""A client's patience: a request queued behind a replica's others waits for them (minutes on a slow 2-core CPU)."""


def run_request(url: str, index: int, outcome: Outcome, max_tokens: int) -> None:
    body = {"prompt": f"hello world {index}", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    try:
        if index % 2:
            with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=REQUEST_TIMEOUT_S) as r:
                if r.status_code != 200:
                    outcome.add("problems", f"stream status {r.status_code}")
                    return
                finishes, errors, done, ids = [], [], 0, set()
                for line in sse_lines(r):
                    if line == "data: [DONE]":
                        done += 1
                    elif line.startswith("data: "):
                        event = json.loads(line[6:])
                        if "error" in event:
                            errors.append(event["error"]["message"])
                        else:
                            ids.add(event["id"])
                            finishes += [c["finish_reason"] for c in event["choices"] if c["finish_reason"]]
                if done != 1 or len(finishes) + len(errors) != 1 or len(ids) > 1:
                    outcome.add("problems", f"stream: done={done} finishes={finishes} errors={errors}")
                elif errors:
                    outcome.add("errors", errors[0])
                else:
                    outcome.add("complete", finishes[0])
                outcome.ids.extend(ids)
        else:
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S)
            if r.status_code == 200:
                outcome.add("complete", r.json()["choices"][0]["finish_reason"])
                outcome.ids.append(r.json()["id"])
            elif r.status_code == 503:
                outcome.add("errors", r.json()["error"]["message"])
            else:
                outcome.add("problems", f"status {r.status_code}: {r.text[:200]}")
    except httpx.HTTPError as exc:
        outcome.add("problems", f"client error {exc!r}")


def load(url: str, count: int, max_tokens: int) -> tuple[Outcome, list[threading.Thread]]:
    outcome = Outcome()
    threads = [threading.Thread(target=run_request, args=(url, i, outcome, max_tokens), daemon=True)
               for i in range(count)]
    for thread in threads:
        thread.start()
    return outcome, threads


def settle(threads: list[threading.Thread], timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a request never ended"


def back_in_rotation(server: ServerProcess, timeout_s: float = 90.0) -> float:
    """Seconds until /health is 200 again (every replica serving)."""
    start = time.monotonic()
    assert wait_for(lambda: health(server.url).status_code == 200, timeout_s, 0.2), health(server.url).text
    return time.monotonic() - start


BOTH_TOKENS = 3000
"""Tokens of each of the two requests that check both replicas serve: they start together and run equally long,
and must outlast the metrics polls that see both replicas' KV in use (1,000 finished between polls on a fast CPU)."""


def both_replicas_take_requests(server: ServerProcess) -> None:
    """Two long requests at once go one to each replica: every rank's KV usage rises."""
    outcome, threads = load(server.url, 2, BOTH_TOKENS)
    seen = wait_for(lambda: all(total(metrics(server.url), "cpllm_kv_cache_usage_perc", rank=str(r)) > 0
                                for r in (0, 1)), 30)
    settle(threads, 240)  # 3,000 tokens each: about a minute on a quiet CPU, several on a loaded one
    assert seen, "a replica took no request"
    assert outcome.complete == ["length", "length"], vars(outcome)


STOP_TOKENS = 1000
"""Tokens of each request of the stop test: still running when the replica is stopped (seconds after all four
start), short enough that the other replica's two finish well within the settle bound on a loaded CPU."""


KILL_LOAD = 8
"""Requests of the kill test: twice the 2 x 2 running slots, so the killed replica has queued ones to re-queue (the
front hands each request to a replica at once); more only lengthen replica 0's work after the kill."""


@pytest.mark.timeout(480)
def test_killed_replica_fails_over_and_comes_back(long_model):
    with ServerProcess.running([long_model, *DP2, "--max-replica-restarts", "1"], timeout_s=240) as server:
        pids = replica_pids(server)
        assert sorted(pids) == [0, 1]
        outcome, threads = load(server.url, KILL_LOAD, 600)
        # 8 requests on 2 x 2 running slots: each replica has started 2 and queues 2
        assert wait_for(lambda: total(metrics(server.url), "vllm:num_requests_waiting") > 0, 20)
        os.kill(pids[1], signal.SIGKILL)
        killed = time.monotonic()
        assert wait_for(lambda: health(server.url).status_code == 503, 5), "the failure was not seen"
        detected = time.monotonic() - killed
        body = health(server.url).json()
        assert body["replicas"][1]["state"] == "restarting" and body["replicas"][0]["state"] == "serving"
        assert health(server.url, "/health/ready").status_code == 200  # replica 0 keeps serving
        gauges = metrics(server.url)
        assert total(gauges, "cpllm_replica_healthy", replica="0") == 1
        assert total(gauges, "cpllm_replica_healthy", replica="1") == 0
        # queued behind the requests replica 0 already holds (on a slow CPU that is minutes, not seconds)
        during = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=180)
        assert during.status_code == 200
        settle(threads, timeout_s=180)
        assert outcome.problems == [], outcome.problems
        assert len(outcome.complete) + len(outcome.errors) == KILL_LOAD  # none lost
        assert len(outcome.ids) == len(set(outcome.ids))  # none answered twice
        assert all("replica 1" in e for e in outcome.errors), outcome.errors
        values = metrics(server.url)
        requeued = total(values, "cpllm_requests_requeued_total")
        ended = total(values, "cpllm_requests_ended_by_replica_failure_total")
        assert requeued >= 1, "no queued request was moved to replica 0"
        assert ended == len(outcome.errors)
        back_in_rotation(server)
        assert total(metrics(server.url), "cpllm_replica_restarts_total", replica="1") == 1
        both_replicas_take_requests(server)
        print(f"killed replica: detected {detected:.2f} s, back {time.monotonic() - killed:.1f} s after the kill; "
              f"{len(outcome.complete)} complete ({requeued:.0f} re-queued), {len(outcome.errors)} ended with an error")


@pytest.mark.timeout(600)  # the bounds inside, on a loaded CPU
def test_stopped_replica_is_taken_out_named_and_restarted(long_model):
    with ServerProcess.running([long_model, *DP2, "--max-replica-restarts", "1"], timeout_s=240) as server:
        pids = replica_pids(server)
        outcome, threads = load(server.url, 4, STOP_TOKENS)
        # 2 running slots on each replica: the gauge sums both (replica 0's alone would read 2)
        assert wait_for(lambda: total(metrics(server.url), "vllm:num_requests_running") == 4, 20)
        os.kill(pids[0], signal.SIGSTOP)
        stopped_at = time.monotonic()
        unhealthy = wait_for(lambda: (r := health(server.url)).status_code == 503 and r, 5)
        assert unhealthy, "a stopped replica left /health at 200"
        assert f"pid {pids[0]}) is stopped by a signal" in unhealthy.json()["error"]["message"]
        settle(threads, DEADLINE_S + 180)
        assert outcome.problems == [], outcome.problems
        assert len(outcome.complete) == 2 and len(outcome.errors) == 2, vars(outcome)  # replica 0 had started 2
        assert all(f"replica 0's driver (pid {pids[0]}) is stopped" in e for e in outcome.errors), outcome.errors
        assert back_in_rotation(server) > 0
        print(f"stopped replica back in rotation {time.monotonic() - stopped_at:.1f} s after SIGSTOP")
        both_replicas_take_requests(server)


@pytest.mark.timeout(300)
def test_idle_stopped_replica_fails_and_without_restarts_the_server_exits(long_model):
    """Replica 1 stopped while idle: out of rotation at once, failed after the deadline (no restart left), replica
    0 serves meanwhile; then replica 0 is killed and nothing can serve: exit status 3."""
    with ServerProcess.running([long_model, *DP2, "--max-replica-restarts", "0"], timeout_s=240) as server:
        pids = replica_pids(server)
        os.kill(pids[1], signal.SIGSTOP)
        unhealthy = wait_for(lambda: (r := health(server.url)).status_code == 503 and r, 5)
        assert unhealthy and f"pid {pids[1]}) is stopped by a signal" in unhealthy.json()["error"]["message"]
        assert unhealthy.json()["replicas"][1]["state"] == "unhealthy"
        for _ in range(3):  # all of them on replica 0, the one in rotation
            ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=60)
            assert ok.status_code == 200
        assert wait_for(lambda: health(server.url).json()["replicas"][1]["state"] == "failed", DEADLINE_S + 8)
        assert wait_for(lambda: gone(pids[1]), 15), "the stopped replica still lives"  # SIGKILLed as it is failed
        assert health(server.url, "/health/live").status_code == 200  # replica 0 still serves
        ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=60)
        assert ok.status_code == 200
        os.kill(pids[0], signal.SIGKILL)
        code = server.process.wait(15)
        assert code == 3, server.log()[-3000:]
        assert "no replica can serve and no restart is left" in server.log()
