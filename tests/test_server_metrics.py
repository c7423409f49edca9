"""/metrics of a real `cpllm serve` under vLLM's names, and `route` labels that come from the route table.

The KV cache holds 24 blocks of 4 tokens (2 KiB each on the tiny model), so a
request with n=4 long completions must preempt, and a repeated prompt hits the
prefix cache: every vLLM series has a reason to move.
"""

from __future__ import annotations

import re
import uuid

import httpx
import openai
import pytest
from tiny_models import save_tiny_hf_model

from cpllm.server.process import ServerProcess

ENGINE_FLAGS = ["--kv-cache-memory-bytes", str(24 * 2048), "--max-model-len", "96", "--block-size", "4"]
PROMPT = "the cat sat on the mat and the dog sat on the log"

COUNTERS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:prefix_cache_queries_total",
            "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total", "vllm:request_success_total")
HISTOGRAMS = ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
              "vllm:time_per_output_token_seconds", "vllm:e2e_request_latency_seconds",
              "vllm:request_queue_time_seconds")
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> str:
    return save_tiny_hf_model(str(tmp_path_factory.mktemp("tiny_metrics")))


@pytest.fixture(scope="module")
def server(model_folder):
    with ServerProcess.running([model_folder, *ENGINE_FLAGS]) as server:
        yield server


def samples(server: ServerProcess) -> dict[tuple[str, frozenset], float]:
    """Every sample of /metrics: (name, labels) -> value."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        match = re.match(r"^([\w:]+)(\{[^}]*\})? (\S+)$", line)
        if match:
            labels = frozenset(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
            out[(match.group(1), labels)] = float(match.group(3))
    return out


def total(scraped: dict, name: str, **labels) -> float:
    wanted = set(labels.items())
    return sum(v for (n, got), v in scraped.items() if n == name and wanted <= got)


@pytest.fixture(scope="module")
def before_and_after(server, model_folder):
    """Scrapes around a few requests: a repeated prompt (prefix hits), n=4 long ones (preemption), a stream."""
    before = samples(server)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", timeout=120, max_retries=0)
    for _ in range(2):
        client.completions.create(model=model_folder, prompt=PROMPT, max_tokens=4, temperature=0)
    client.completions.create(model=model_folder, prompt="hello", max_tokens=60, n=4, temperature=1.0, seed=1,
                              extra_body={"ignore_eos": True})
    stream = client.chat.completions.create(model=model_folder, messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=5, stream=True)
    assert [chunk for chunk in stream]
    return before, samples(server)


def test_vllm_counters_and_histograms_exist_and_move(before_and_after, model_folder):
    before, after = before_and_after
    for name in COUNTERS:
        assert total(after, name, model_name=model_folder) > total(before, name, model_name=model_folder), name
    for name in HISTOGRAMS:
        count = f"{name}_count"
        assert total(after, count, model_name=model_folder) > total(before, count, model_name=model_folder), name
        assert total(after, f"{name}_bucket", le="+Inf") == total(after, count)
    for name in GAUGES:
        assert (name, frozenset({("model_name", model_folder)})) in after, name
    assert total(after, "vllm:request_success_total", finished_reason="length") >= 4
    hits = total(after, "vllm:prefix_cache_hits_total") - total(before, "vllm:prefix_cache_hits_total")
    queries = total(after, "vllm:prefix_cache_queries_total") - total(before, "vllm:prefix_cache_queries_total")
    assert 0 < hits < queries


def test_cpllm_series_stay_beside_them(before_and_after):
    _, after = before_and_after
    for name in ("cpllm_request_success_total", "cpllm_time_to_first_token_seconds_count",
                 "cpllm_kv_cache_usage_perc", "cpllm_http_requests_total"):
        assert total(after, name) > 0 or any(n == name for n, _ in after), name


def test_route_label_is_the_route_template_and_unknown_paths_add_no_series(server, before_and_after):
    _, after = before_and_after
    assert total(after, "cpllm_http_requests_total", route="/v1/completions", status="200") >= 3
    assert total(after, "cpllm_http_requests_total", route="/v1/chat/completions", status="200") >= 1
    assert httpx.get(f"{server.url}/v1/zz-{uuid.uuid4().hex}", timeout=10).status_code == 404
    first = samples(server)
    assert httpx.get(f"{server.url}/v1/zz-{uuid.uuid4().hex}", timeout=10).status_code == 404
    assert httpx.post(f"{server.url}/scan/{uuid.uuid4().hex}.php", timeout=10).status_code == 404
    second = samples(server)
    assert set(second) == set(first), set(second) ^ set(first)
    assert not any("zz-" in value for _, labels in second for _, value in labels)
    unmatched = total(second, "cpllm_http_requests_total", route="unmatched", status="404")
    assert unmatched - total(first, "cpllm_http_requests_total", route="unmatched", status="404") == 2
    assert httpx.delete(f"{server.url}/health", timeout=10).status_code == 405
    assert total(samples(server), "cpllm_http_requests_total", route="/health", status="405") == 1
