"""`cpllm serve --api-server-count 2` on the tiny random model: two HTTP processes on one port in front of one
engine. Requests on fresh connections land on both processes (their log lines say which) and reach the same
engine (a prompt one process ran is a prefix-cache hit through the other); concurrent requests all finish;
/metrics sums both processes; SIGTERM or SIGINT drains and leaves no process of the server behind, and so does
an API server that dies on its own."""

from __future__ import annotations

import concurrent.futures
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

from cpllm.server.process import ServerProcess

BLOCK = 4
FLAGS = ["--kv-cache-memory-bytes", "8MiB", "--max-model-len", "256", "--block-size", str(BLOCK),
         "--served-model-name", "tiny", "--dtype", "float", "--enable-log-requests",
         "--enable-prompt-tokens-details", "--api-server-count", "2", "--shutdown-timeout", "10"]
PROMPT = [5 + i % 200 for i in range(6 * BLOCK)]  # token ids: whole blocks the prefix cache can hold
RECEIVED = re.compile(r"api server (\d): \S+: received request (\S+):")


def _wait_for_both(server: ServerProcess, timeout_s: float = 300.0) -> ServerProcess:
    """Healthy, and both API servers accept connections (the first healthy one may be alone for a moment)."""
    server.wait_ready(timeout_s)
    deadline = time.monotonic() + timeout_s
    while not all(f"api server {i} (pid" in server.log() for i in (0, 1)):
        assert time.monotonic() < deadline, server.log()[-4000:]
        time.sleep(0.2)
    return server


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return save_tiny_hf_model(str(tmp_path_factory.mktemp("tiny_api_servers")))


@pytest.fixture(scope="module")
def server(model):
    server = ServerProcess([model, *FLAGS])
    try:
        yield _wait_for_both(server)
    finally:
        server.close()


def complete(url: str, prompt=PROMPT, max_tokens: int = 8) -> dict:
    """One greedy completion on a connection of its own (a new connection may land on either process)."""
    reply = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True})
    assert reply.status_code == 200, reply.text
    return reply.json()


def served_by(server: ServerProcess) -> dict[str, int]:
    """Request id -> the API server whose log received it."""
    return {request_id: int(index) for index, request_id in RECEIVED.findall(server.log())}


def test_requests_on_both_processes_reach_one_engine(server):
    first = complete(server.url)
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda _: complete(server.url), range(24)))
    assert len({reply["id"] for reply in replies}) == 24  # none lost, none answered twice
    expected = first["choices"][0]["token_ids"]
    assert all(reply["choices"][0]["token_ids"] == expected for reply in replies)  # one model, greedy
    # every later request found the first one's blocks in the cache: the same engine ran them all
    assert all(reply["usage"]["prompt_tokens_details"]["cached_tokens"] >= BLOCK for reply in replies)
    owners = served_by(server)
    assert {owners[reply["id"]] for reply in [first, *replies]} == {0, 1}, "one process got every connection"


def test_concurrent_streams_are_not_lost(server):
    def stream(i: int) -> list[int]:
        with httpx.stream("POST", f"{server.url}/v1/completions", timeout=120, json={
                "model": "tiny", "prompt": [7 + i, *PROMPT[:5]], "max_tokens": 12, "temperature": 0,
                "ignore_eos": True, "stream": True, "return_token_ids": True}) as reply:
            assert reply.status_code == 200
            events = [line.removeprefix("data: ") for line in reply.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        return [t for event in events[:-1] for t in json.loads(event)["choices"][0].get("token_ids") or []]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        tokens = list(pool.map(stream, range(16)))
    assert all(len(ids) == 12 for ids in tokens)
    again = [complete(server.url, [7 + i, *PROMPT[:5]], 12)["choices"][0]["token_ids"] for i in (0, 5)]
    assert again == [tokens[0], tokens[5]]  # streamed through either process, the same greedy tokens


def _success_total(text: str) -> float:
    return sum(float(value) for value in re.findall(r'^cpllm_request_success_total\{[^}]*\} (\S+)$', text, re.M))


def test_metrics_sum_every_process(server):
    before = [_success_total(httpx.get(f"{server.url}/metrics", timeout=30).text) for _ in range(4)]
    assert len(set(before)) == 1  # whichever process answers, the same sum
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda _: complete(server.url, max_tokens=2), range(10)))
    scrapes = [httpx.get(f"{server.url}/metrics", timeout=30).text for _ in range(6)]
    assert {_success_total(text) for text in scrapes} == {before[0] + 10}
    for text in scrapes:  # the engine's gauges once, not once per process
        assert len(re.findall(r"^vllm:num_requests_running\{", text, re.M)) == 1
        assert re.search(r'^cpllm_replica_healthy\{model_name="tiny",replica="0"\} 1\.0$', text, re.M)


def _server_processes(server: ServerProcess) -> list[psutil.Process]:
    """Every process of the server's session (the engine process, its API servers, any rank)."""
    found = []
    for process in psutil.process_iter(["pid"]):
        try:
            if os.getsid(process.pid) == server.process.pid:
                found.append(process)
        except (ProcessLookupError, psutil.Error):
            pass
    return found


def _stream_tokens(url: str, started: threading.Event, max_tokens: int) -> int:
    """A streamed completion on a connection of its own; sets `started` at its first event; its token count."""
    count = 0
    with httpx.stream("POST", f"{url}/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                started.set()
                count += len(json.loads(line.removeprefix("data: "))["choices"][0].get("token_ids") or [])
    return count


@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT", "api server killed"])
def test_shutdown_leaves_no_process(model, how):
    server = ServerProcess([model, *FLAGS])
    try:
        _wait_for_both(server)
        children = psutil.Process(server.process.pid).children(recursive=True)
        assert len(children) >= 2  # both API servers
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            started = [threading.Event() for _ in range(4)]
            running = [pool.submit(_stream_tokens, server.url, event, 64) for event in started]
            assert all(event.wait(120) for event in started)  # every request is in flight
            if how == "api server killed":
                os.kill(children[0].pid, signal.SIGKILL)
            else:
                server.process.send_signal(getattr(signal, how))
            code = server.process.wait(60)
            if how != "api server killed":  # a drain: the requests in flight finished
                assert [f.result() for f in running] == [64] * 4
        assert code == (1 if how == "api server killed" else 0), server.log()[-4000:]
        deadline = time.monotonic() + 10
        while _server_processes(server) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _server_processes(server) == [], server.log()[-4000:]
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{server.url}/health", timeout=5)
    finally:
        server.close()
