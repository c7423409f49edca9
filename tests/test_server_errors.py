"""`cpllm serve` refuses bad input with OpenAI-shaped errors and keeps serving; API key; SIGTERM; -pcp 2.

One server per module (with --api-key and --served-model-name); the SIGTERM and
-pcp tests start their own processes.
"""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest
from tiny_models import save_tiny_hf_model

from cpllm.engine.llm import LLM
from cpllm.engine.sampling_params import SamplingParams
from cpllm.server.options import ServeOptions
from cpllm.server.process import ServerProcess

ENGINE_FLAGS = ["--kv-cache-memory-bytes", "4MiB", "--max-model-len", "256", "--block-size", "4"]
KEY = "test-key-123"
NAME = "tiny"


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> str:
    return save_tiny_hf_model(str(tmp_path_factory.mktemp("tiny_server_errors")))


@pytest.fixture(scope="module")
def server(model_folder):
    args = [model_folder, *ENGINE_FLAGS, "--api-key", KEY, "--served-model-name", NAME]
    with ServerProcess.running(args) as server:
        yield server


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, timeout=60, max_retries=0)


def assert_openai_error(response: httpx.Response, status: int, param: str | None = "") -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    if param != "":
        assert error["param"] == param, error
    return error


def completion(http: httpx.Client, **fields) -> httpx.Response:
    return http.post("/v1/completions", json={"model": NAME, "prompt": "hello", "max_tokens": 4, **fields})


def chat(http: httpx.Client, **fields) -> httpx.Response:
    body = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}
    return http.post("/v1/chat/completions", json=body)


# ---- authentication and model name ---------------------------------------------------------------------


def test_api_key_required(server):
    body = {"model": NAME, "prompt": "hello", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        assert_openai_error(httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=30), 401)
    assert_openai_error(httpx.get(f"{server.url}/v1/models", timeout=30), 401)
    ok = httpx.post(f"{server.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert ok.status_code == 200
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200  # probes need no key
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()


def test_unknown_model_is_404(http, client):
    assert_openai_error(completion(http, model="gpt-4"), 404, "model")
    assert_openai_error(chat(http, model="nope"), 404, "model")
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="hi", max_tokens=2)
    assert [m.id for m in client.models.list().data] == [NAME]


# ---- invalid fields ------------------------------------------------------------------------------------


@pytest.mark.parametrize("fields, param", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"max_tokens": 250, "prompt": "hello world " * 20}, "max_tokens"),
    ({"max_tokens": 1, "prompt": [5] * 256}, "max_tokens"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 0}, "n"),
    ({"logprobs": 21}, "logprobs"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"top_k": -2}, "top_k"),
    ({"prompt": [1, 300000]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": None}, None),
    ({"stop": [""]}, "stop"),
    ({"stream_options": {"include_usage": True}}, None),
])  # fmt: skip
def test_bad_completion_fields_are_400(http, fields, param):
    error = assert_openai_error(completion(http, **fields), 400)
    if param is not None:
        assert error["param"] == param, error


def test_missing_prompt_is_400(http):
    error = assert_openai_error(http.post("/v1/completions", json={"model": NAME, "max_tokens": 3}), 400, "prompt")
    assert "prompt" in error["message"]


@pytest.mark.parametrize("messages", [
    [],
    "hello",
    [{"content": "no role"}],
    [{"role": 7, "content": "hi"}],
    [{"role": "user", "content": 42}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
])  # fmt: skip
def test_malformed_messages_are_400(http, messages):
    error = assert_openai_error(chat(http, messages=messages), 400)
    assert error["param"].startswith("messages"), error


def test_bad_chat_fields_are_400(http):
    assert_openai_error(chat(http, max_completion_tokens=0), 400, "max_completion_tokens")
    assert_openai_error(chat(http, max_tokens=300), 400, "max_tokens")
    assert_openai_error(chat(http, top_logprobs=2), 400)  # without logprobs=true
    assert_openai_error(chat(http, temperature=9), 400, "temperature")


def test_bad_json_and_empty_body_are_400(http):
    json_header = {"content-type": "application/json"}
    assert_openai_error(http.post("/v1/completions", content=b"{not json", headers=json_header), 400)
    assert_openai_error(http.post("/v1/completions", content=b""), 400)
    assert_openai_error(http.post("/v1/chat/completions", content=b"[1, 2]"), 400)


def test_oversized_body_is_413(http):
    body = json.dumps({"model": NAME, "prompt": "a" * (ServeOptions().body_limit(256) + 10), "max_tokens": 2}).encode()
    try:
        response = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    except httpx.HTTPError as exc:  # the server may close the connection before reading the whole upload
        pytest.fail(f"expected a 413 response, got {exc!r}")
    assert_openai_error(response, 413)


def test_openai_client_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=NAME, prompt="hello", max_tokens=0)
    assert info.value.status_code == 400
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}], temperature=-1)


def test_errors_do_not_disturb_other_requests(http, server, model_folder):
    """A long stream runs while bad requests come and go; it still completes with the right text."""
    with LLM(model_folder, max_model_len=256, block_size=4, kv_cache_memory_bytes=4 * 2**20) as llm:
        ref = llm.generate("the cat sat", SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))[0]
    streamed: list[str] = []

    def consume():
        body = {"model": NAME, "prompt": "the cat sat", "max_tokens": 200, "temperature": 0, "ignore_eos": True,
                "stream": True, "n": 4}
        with http.stream("POST", "/v1/completions", json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:])["choices"]:
                        if choice["index"] == 0:
                            streamed.append(choice["text"])

    worker = threading.Thread(target=consume)
    worker.start()
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as other:
        for _ in range(5):
            assert_openai_error(completion(other, max_tokens=-1), 400)
            assert_openai_error(chat(other, messages=[]), 400)
            assert_openai_error(completion(other, model="x"), 404)
    worker.join(120)
    assert not worker.is_alive()
    assert "".join(streamed) == ref.outputs[0].text
    after = completion(http, temperature=0)
    assert after.status_code == 200 and after.json()["choices"][0]["finish_reason"] in ("length", "stop")


# ---- process life: SIGTERM, -pcp 2 ---------------------------------------------------------------------


def test_sigterm_finishes_in_flight_requests_and_exits_zero(model_folder):
    # a drain long enough for a loaded machine (what ends a stream past it: tests/test_faults.py)
    proc = ServerProcess([model_folder, *ENGINE_FLAGS, "--shutdown-timeout", "120"])
    try:
        proc.wait_ready()
        chunks: list[dict] = []
        opened = threading.Event()

        def consume():
            body = {"prompt": "hello", "max_tokens": 240, "ignore_eos": True, "stream": True, "n": 4}
            with httpx.stream("POST", f"{proc.url}/v1/completions", json=body, timeout=60) as response:
                for line in response.iter_lines():
                    opened.set()
                    if line.startswith("data: {"):
                        chunks.append(json.loads(line[6:]))

        worker = threading.Thread(target=consume)
        worker.start()
        assert opened.wait(60)
        assert proc.stop(timeout_s=150) == 0
        worker.join(60)
        finishes = [c["finish_reason"] for chunk in chunks for c in chunk["choices"] if c["finish_reason"]]
        assert sorted(finishes) == ["length"] * 4  # the request in flight was finished, not cut off
        assert "SIGTERM" in proc.log()
    finally:
        proc.close()


def _greedy_answers(proc: ServerProcess) -> list[str]:
    client = openai.OpenAI(base_url=f"{proc.url}/v1", api_key="x", timeout=120, max_retries=0)
    # The last prompt extends the first: a prefix-cache hit, so a short chunk on a cached context.
    prompts = ["the cat sat on the mat " * 6, "hello world", "The world is", "the cat sat on the mat " * 6 + "and"]
    texts = [client.completions.create(model=client.models.list().data[0].id, prompt=p, max_tokens=12,
                                       temperature=0, extra_body={"ignore_eos": True}).choices[0].text
             for p in prompts]
    texts.append(client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=8, temperature=0,
                                                messages=[{"role": "user", "content": "hello"}]).choices[0]
                 .message.content)
    return texts


def _strategy_counts(proc: ServerProcess) -> dict[str, float]:
    text = httpx.get(f"{proc.url}/metrics", timeout=10).text
    counts = {}
    for line in text.splitlines():
        if line.startswith("cpllm_cp_prefill_strategy_steps_total{"):
            strategy = line.split('strategy="')[1].split('"')[0]
            counts[strategy] = float(line.rsplit(" ", 1)[1])
    return counts


def test_pcp2_server_answers_like_pcp1(model_folder):
    single = ServerProcess([model_folder, *ENGINE_FLAGS])
    try:
        expected = _greedy_answers(single.wait_ready())
    finally:
        single.close()
    pcp = ServerProcess([model_folder, *ENGINE_FLAGS, "-pcp", "2", "--threads-per-rank", "1",
                         "--cp-prefill-strategy", "auto"])
    try:
        assert _greedy_answers(pcp.wait_ready(timeout_s=180)) == expected
        # auto's choices are exported: fresh prompts all-gathered (shared memory on this host), the prefix hit's
        # short chunk on pass-Q.
        counts = _strategy_counts(pcp)
        assert counts["allgather"] >= 3 and counts["pass-q"] >= 1 and counts["ring"] == 0, counts
        assert pcp.stop(timeout_s=60) == 0
    finally:
        pcp.close()
