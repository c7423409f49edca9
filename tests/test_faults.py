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
import pytest
from tiny_models import save_tiny_hf_model

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
