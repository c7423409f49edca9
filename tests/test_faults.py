"""Faults of a served engine, on real processes over loopback: abandoned requests and shutdown.

Every wait here is bounded. The model is the tiny random Llama with room for long outputs (4,096 positions),
so that a request is still running when the test acts on it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import httpx
import psutil
import pytest
from tiny_models import save_tiny_hf_model

from cpllm.server.options import ServeOptions
from cpllm.server.process import ServerProcess

LONG_FLAGS = ["--max-model-len", "4096", "--kv-cache-memory-bytes", "24MiB", "--block-size", "16",
              "--max-num-seqs", "8"]
LONG = {"prompt": "hello world", "max_tokens": 4000, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def long_model(tmp_path_factory) -> str:
    return save_tiny_hf_model(str(tmp_path_factory.mktemp("tiny_faults")), max_position_embeddings=4096)


def metrics(url: str) -> dict[str, float]:
    """Series name + labels -> value (labels sorted, so keys are stable)."""
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        match = re.match(r"^([\w:]+)(\{[^}]*\})? (\S+)$", line)
        if match:
            out[match.group(1) + (match.group(2) or "")] = float(match.group(3))
    return out


def total(values: dict[str, float], name: str, **labels) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    found = 0.0
    for key, value in values.items():
        series, _, rest = key.partition("{")
        got = dict(re.findall(r'(\w+)="([^"]*)"', rest))
        if series == name and all(got.get(k) == v for k, v in labels.items()):
            found += value
    return found


def wait_for(condition, timeout_s: float, poll_s: float = 0.05):
    """The first truthy value of condition() within timeout_s, else None."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(poll_s)
    return None


def kv_usage(url: str) -> float:
    return total(metrics(url), "vllm:kv_cache_usage_perc")


# ---- 1. abandoned non-streamed requests ---------------------------------------------------------------


@pytest.mark.timeout(180)
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_non_streamed_request_whose_client_left_is_aborted(long_model, route):
    body = dict(LONG, n=4) if route == "/v1/completions" else {
        "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4000, "ignore_eos": True, "n": 4}
    with ServerProcess.running([long_model, *LONG_FLAGS]) as server:
        aborted_before = total(metrics(server.url), "vllm:request_success_total", finished_reason="abort")
        failure: list[BaseException] = []

        def impatient_client():
            try:
                httpx.post(f"{server.url}{route}", json=body, timeout=httpx.Timeout(60, read=1.5))
            except httpx.ReadTimeout as exc:  # the client gives up and closes its connection
                failure.append(exc)

        client = threading.Thread(target=impatient_client)
        client.start()
        assert wait_for(lambda: kv_usage(server.url) > 0, 10), "the request never started"
        client.join(30)
        assert failure, "the request finished before the client gave up: make it longer"
        left = time.monotonic()
        assert wait_for(lambda: kv_usage(server.url) == 0, 2.0), "KV blocks still held 2 s after the client left"
        freed_after = time.monotonic() - left
        values = metrics(server.url)
        assert total(values, "vllm:num_requests_running") == 0
        assert total(values, "vllm:request_success_total", finished_reason="abort") == aborted_before + 4
        assert re.search(r"request \S+ status=499 .*finish=abort", server.log()), server.log()[-2000:]
        print(f"KV freed {freed_after:.2f} s after the client left")


# ---- helpers for the process-level tests ----------------------------------------------------------------


def rank_pids(server: ServerProcess) -> dict[int, int]:
    """Global rank -> pid of each rank process the server spawned (python -m cpllm.distributed.rank_entry R FD)."""
    found = {}
    for proc in psutil.Process(server.process.pid).children(recursive=True):
        try:
            cmd = proc.cmdline()
        except psutil.Error:
            continue
        if "cpllm.distributed.rank_entry" in cmd:
            found[int(cmd[cmd.index("cpllm.distributed.rank_entry") + 1])] = proc.pid
    return found


def shm_files_of(pids) -> list[str]:
    return [name for name in os.listdir("/dev/shm") if any(name.startswith(f"cpllm-{pid}-") for pid in pids)]


class StreamReader(threading.Thread):
    """One streamed completion read in the background: every data line, and whether it ended with [DONE]."""

    def __init__(self, url: str, body: dict | None = None):
        super().__init__(daemon=True)
        self.url, self.body = url, {**(body or LONG), "stream": True}
        self.events: list = []
        self.opened = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=self.body, timeout=60) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
                        self.opened.set()
        except BaseException as exc:  # noqa: BLE001 - asserted by the test
            self.error = exc
        self.opened.set()

    def error_event(self) -> dict | None:
        return next((e["error"] for e in self.events if isinstance(e, dict) and "error" in e), None)


def health(url: str, path: str = "/health") -> httpx.Response:
    return httpx.get(f"{url}{path}", timeout=5)


# ---- 2. shutdown ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [-1.0, 3601.0])
def test_shutdown_timeout_out_of_range_is_refused_naming_the_flag(value):
    with pytest.raises(ValueError, match=r"--shutdown-timeout must be in \[0, 3600\] seconds, got"):
        ServeOptions(shutdown_timeout_s=value)
    assert ServeOptions().shutdown_timeout_s < 30  # inside Kubernetes' default grace period


@pytest.mark.timeout(240)
def test_sigterm_ends_long_streams_with_an_error_event_and_done(long_model):
    timeout_s = 2.0
    args = [long_model, *LONG_FLAGS, "-pcp", "2", "--threads-per-rank", "1", "--shutdown-timeout", str(timeout_s)]
    with ServerProcess.running(args, timeout_s=180) as server:
        ranks = rank_pids(server)
        assert sorted(ranks) == [1]
        pids = [server.process.pid, *ranks.values()]
        readers = [StreamReader(server.url) for _ in range(3)]
        for reader in readers:
            reader.start()
        assert all(reader.opened.wait(30) for reader in readers)
        sent = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        code = server.process.wait(timeout_s + 30)
        took = time.monotonic() - sent
        for reader in readers:
            reader.join(10)
        log = server.log()
    assert code == 0, log[-3000:]
    assert took < timeout_s + 1.0, f"exited {took:.2f} s after SIGTERM (--shutdown-timeout {timeout_s})"
    for reader in readers:
        assert reader.error is None, reader.error
        assert reader.events[-1] == "[DONE]" and reader.events.count("[DONE]") == 1
        error = reader.events[-2]["error"]
        assert "--shutdown-timeout" in error["message"] and error["type"] == "service_unavailable"
        assert not any(c.get("finish_reason") for e in reader.events[:-2] for c in e.get("choices", []))
    assert len(re.findall(r"request cmpl-\S+ status=503 .*finish=abort", log)) == 3, log[-3000:]
    assert wait_for(lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
                                    for p in pids), 5), "rank processes outlived the server"
    assert shm_files_of(pids) == []
    print(f"exit {took:.2f} s after SIGTERM with --shutdown-timeout {timeout_s}")


# ---- 3. exit when nothing can serve; 4. a hung rank is named ----------------------------------------------

PCP2 = ["-pcp", "2", "--threads-per-rank", "1"]
DEADLINE_S = 5.0
"""--distributed-timeout of the hung-rank tests: a stalled rank must be named within this plus 5 s."""


def assert_exits_failed(server: ServerProcess, within_s: float = 15.0) -> None:
    """The server exits on its own, with the status that tells a supervisor to restart it."""
    code = server.process.wait(within_s)
    assert code == 3, server.log()[-3000:]
    assert "no replica can serve any more" in server.log()


@pytest.mark.timeout(240)
def test_killed_rank_ends_the_streams_and_the_server_exits_nonzero(long_model):
    with ServerProcess.running([long_model, *LONG_FLAGS, *PCP2], timeout_s=180) as server:
        rank1 = rank_pids(server)[1]
        reader = StreamReader(server.url)
        reader.start()
        assert reader.opened.wait(30)
        os.kill(rank1, signal.SIGKILL)
        reader.join(15)
        assert not reader.is_alive() and reader.error is None
        error = reader.error_event()
        assert error is not None and f"worker rank 1 (pid {rank1})" in error["message"], reader.events[-3:]
        assert reader.events[-1] == "[DONE]"
        assert_exits_failed(server)


def _stalled_message(rank1: int) -> str:
    return f"worker rank 1 (pid {rank1}) is stopped by a signal (SIGSTOP)"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("transport", ["auto", "gloo"])
def test_rank_stopped_inside_a_step_is_named_within_the_deadline(long_model, transport):
    args = [long_model, *LONG_FLAGS, *PCP2, "--distributed-timeout", str(DEADLINE_S), "--collective-transport",
            transport]
    with ServerProcess.running(args, timeout_s=180) as server:
        rank1 = rank_pids(server)[1]
        reader = StreamReader(server.url)
        reader.start()
        assert reader.opened.wait(30)
        os.kill(rank1, signal.SIGSTOP)
        stopped_at = time.monotonic()
        unhealthy = wait_for(lambda: (r := health(server.url)).status_code == 503 and r, DEADLINE_S + 5)
        assert unhealthy, "/health stayed 200 with a stopped rank"
        body = unhealthy.json()
        assert body["replicas"][0]["replica"] == 0 and body["replicas"][0]["state"] != "serving"
        assert _stalled_message(rank1) in body["error"]["message"], body
        reader.join(DEADLINE_S + 5)
        named_after = time.monotonic() - stopped_at
        assert not reader.is_alive(), "the stream still hangs past the deadline"
        error = reader.error_event()
        assert error is not None and _stalled_message(rank1) in error["message"], reader.events[-3:]
        assert reader.events[-1] == "[DONE]"
        assert_exits_failed(server)
        print(f"{transport}: stopped rank named {named_after:.2f} s after SIGSTOP (--distributed-timeout "
              f"{DEADLINE_S})")


@pytest.mark.timeout(240)
def test_rank_stopped_while_idle_fails_health_and_the_next_request_names_it(long_model):
    args = [long_model, *LONG_FLAGS, *PCP2, "--distributed-timeout", str(DEADLINE_S)]
    with ServerProcess.running(args, timeout_s=180) as server:
        rank1 = rank_pids(server)[1]
        os.kill(rank1, signal.SIGSTOP)
        unhealthy = wait_for(lambda: (r := health(server.url)).status_code == 503 and r, 5)
        assert unhealthy and _stalled_message(rank1) in unhealthy.json()["error"]["message"]
        assert health(server.url, "/health/ready").status_code == 503  # its one replica takes no requests
        sent = time.monotonic()
        response = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hello", "max_tokens": 4},
                              timeout=DEADLINE_S + 10)
        answered_after = time.monotonic() - sent
        assert response.status_code == 503, response.text
        assert _stalled_message(rank1) in response.json()["error"]["message"]
        # what the driver waited for: the next step's broadcast, or (the rank had entered it before it stopped) a
        # collective inside the step
        assert re.search(r"the step waited .* in |the driver's wait failed: .*waiting for rank",
                         response.json()["error"]["message"])
        assert_exits_failed(server)
        print(f"request answered {answered_after:.2f} s after it was sent (--distributed-timeout {DEADLINE_S})")
