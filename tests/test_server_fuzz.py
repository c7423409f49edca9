"""Property-based fuzzing of the generation, Responses and tokenizer endpoints from the server's OpenAPI document.

Cases come from the request schemas the server publishes at /openapi.json: bodies
that fit them (positive) and bodies that do not (negative: wrong types, unknown
fields, bytes that are not JSON). Whatever arrives, the answer must not be a 5xx
(nor a 5xx error event inside a stream), and afterwards the server must still
serve and hold no KV blocks. Bounded: a fixed, derandomized number of cases per
endpoint, on the tiny model with a short max_model_len.
"""

from __future__ import annotations

import re
import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from tiny_models import save_tiny_hf_model

from cpllm.server.process import ServerProcess

FLAGS = ["--kv-cache-memory-bytes", "4MiB", "--max-model-len", "64", "--block-size", "4", "--max-n", "4",
         "--max-num-seqs", "8"]
EXAMPLES = 150
"""Cases per endpoint (positive and negative mixed)."""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = save_tiny_hf_model(str(tmp_path_factory.mktemp("tiny_fuzz")))
    with ServerProcess.running([folder, *FLAGS]) as server:
        yield server


@pytest.fixture(scope="module")
def openapi(server) -> dict:
    return httpx.get(f"{server.url}/openapi.json", timeout=30).json()


def _check(status: int, text: str, case: schemathesis.Case) -> None:
    body = repr(case.body)[:500]
    assert status < 500, f"{status} for {body}: {text[:500]}"
    assert '"type":"internal_server_error"' not in text, f"in-band 500 for {body}: {text[:500]}"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize",
                                  "/detokenize"])
def test_fuzz_endpoint_never_5xx(server, openapi, path):
    operation = schemathesis.openapi.from_dict(openapi)[path]["POST"]
    cases = (operation.as_strategy(schemathesis.GenerationMode.POSITIVE)
             | operation.as_strategy(schemathesis.GenerationMode.NEGATIVE))
    seen: dict[int, int] = {}

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=cases)
    def run(case: schemathesis.Case) -> None:
        response = case.call(base_url=server.url, timeout=120)
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        _check(response.status_code, response.text, case)

    run()
    print(path, dict(sorted(seen.items())))  # shown with -s: how the cases were answered
    assert seen.get(200, 0) > 0 and sum(n for s, n in seen.items() if 400 <= s < 500) > 0, seen


def test_server_still_serves_after_fuzzing(server):
    response = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hello", "max_tokens": 4}, timeout=60)
    assert response.status_code == 200 and response.json()["choices"][0]["text"] is not None
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # aborted fuzz streams free their blocks
        metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
        usage = [float(v) for v in re.findall(r'^cpllm_kv_cache_usage_perc\{[^}]*\} (\S+)$', metrics, re.M)]
        if usage and max(usage) == 0.0:
            break
        time.sleep(0.2)
    assert usage and max(usage) == 0.0
    assert "Traceback" not in server.log()
