"""`cpllm router` in front of real `cpllm serve` processes on a tiny random model (docs/disaggregated.md, "The
router"): two prefill instances of different layouts (PCP = 2 with interleave 2 and block size 4; one rank with
block size 8) and one decode instance (one rank, block size 8). Greedy output through the router equals the
decode instance's answer computed alone (which the layout tests hold to the single rank's), streamed or not;
/health reports each instance; the faults: a prefill instance that dies (the router goes on with the other; a
decode pull from it fails that request by name and leaves nothing held), the decode instance that dies (an error
naming it, /health 503, the prefill side frees the blocks at its abort timeout)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest
from test_disagg_engine import free_ports
from tiny_models import save_tiny_hf_model

from cpllm.server.process import ServerProcess, free_port
from parallel_helpers import random_prompt

FLAGS = ["--kv-cache-memory-bytes", "1MiB", "--max-model-len", "128", "--served-model-name", "tiny",
         "--threads-per-rank", "1"]
PROMPTS = [random_prompt(21, seed=21), random_prompt(9, seed=9), random_prompt(30, seed=30)]
ABORT_TIMEOUT_S = 4.0


def kv_flag(role: str, port: int, **extra) -> list[str]:
    return ["--kv-transfer-config", json.dumps({"kv_connector": "CpllmConnector", "kv_role": role,
                                                 "kv_ip": "127.0.0.1", "kv_port": port,
                                                 "kv_connector_extra_config": extra})]


class Router:
    """`python -m cpllm router` on loopback."""

    def __init__(self, prefill: list[str], decode: list[str]):
        self.url = f"http://127.0.0.1:{(port := free_port())}"
        self.process = subprocess.Popen([sys.executable, "-m", "cpllm", "router", "--prefill", *prefill,
                                         "--decode", *decode, "--port", str(port), "--health-interval-s", "0.5"],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.process.stderr.read()
            try:
                httpx.get(f"{self.url}/health", timeout=5)
                return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise TimeoutError("the router did not answer /health within 60 s")

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(10)


def assert_router_matches(router_url: str, prompts: list[list[int]], offline: list, max_tokens: int) -> None:
    """Each prompt's greedy completion through the router: the offline answer's text, logprobs within 1e-4."""
    for prompt, want in zip(prompts, offline):
        response = httpx.post(f"{router_url}/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 1,
            "ignore_eos": True})
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["text"] == want.text
        got = choice["logprobs"]["token_logprobs"]
        ref = [lp[t].logprob for lp, t in zip(want.logprobs, want.token_ids)]
        assert max(abs(a - b) for a, b in zip(got, ref, strict=True)) <= 1e-4


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    folder = save_tiny_hf_model(str(tmp_path_factory.mktemp("tiny_router")), seed=5, num_key_value_heads=1)
    abort = {"abort_timeout_s": ABORT_TIMEOUT_S}
    wide = ServerProcess([folder, *FLAGS, "-pcp", "2", "--cp-kv-cache-interleave-size", "2", "--block-size", "4",
                          *kv_flag("kv_producer", free_ports(3), **abort)])
    narrow = ServerProcess([folder, *FLAGS, "--block-size", "8", *kv_flag("kv_producer", free_ports(2), **abort)])
    decode = ServerProcess([folder, *FLAGS, "--block-size", "8",
                            *kv_flag("kv_consumer", free_ports(2), transfer_timeout_s=2.0)])
    servers = [wide, narrow, decode]
    try:
        for server in servers:  # started together, waited for in turn
            server.wait_ready(300)
        router = Router([wide.url, narrow.url], [decode.url])
        try:
            yield {"wide": wide, "narrow": narrow, "decode": decode, "router": router}
        finally:
            router.close()
    finally:
        for server in servers:
            server.close()


def post(url: str, path: str, **fields) -> httpx.Response:
    return httpx.post(f"{url}{path}", json={"model": "tiny", "temperature": 0, "ignore_eos": True, **fields},
                      timeout=120)


def complete(url: str, prompt: list[int], **fields) -> dict:
    response = post(url, "/v1/completions", prompt=prompt, max_tokens=8, logprobs=1, **fields)
    assert response.status_code == 200, response.text
    return response.json()


def assert_same_completion(got: dict, want: dict) -> None:
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    a, b = got["choices"][0]["logprobs"]["token_logprobs"], want["choices"][0]["logprobs"]["token_logprobs"]
    assert len(a) == 8 and max(abs(x - y) for x, y in zip(a, b, strict=True)) <= 1e-4


def health(router: Router) -> httpx.Response:
    return httpx.get(f"{router.url}/health", timeout=30)


def kv_usage(server: ServerProcess) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("vllm:kv_cache_usage_perc"))


def test_greedy_through_the_router_equals_one_instance(cluster):
    router, decode = cluster["router"], cluster["decode"]
    for prompt in PROMPTS:
        assert_same_completion(complete(router.url, prompt), complete(decode.url, prompt))
    body = health(router).json()
    assert body["status"] == "ok" and [i["url"] for i in body["prefill"]] == [cluster["wide"].url,
                                                                               cluster["narrow"].url]
    assert all(i["sent"] >= 1 and i["in_flight"] == 0 for i in body["prefill"])  # both prefill instances served
    assert body["decode"][0]["sent"] == len(PROMPTS)
    for instance in body["prefill"] + body["decode"]:  # each server's own /metrics read: idle after the requests
        assert instance["reported_queue"] == 0 and instance["load"] == 0, instance


def test_chat_streams_through_the_router(cluster):
    router, decode = cluster["router"], cluster["decode"]
    chat = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 6}
    want = post(decode.url, "/v1/chat/completions", **chat).json()["choices"][0]["message"]["content"]
    text = ""
    with httpx.stream("POST", f"{router.url}/v1/chat/completions", timeout=120,
                      json={"model": "tiny", "temperature": 0, "ignore_eos": True, "stream": True, **chat}) as stream:
        assert stream.status_code == 200 and stream.headers["content-type"].startswith("text/event-stream")
        for line in stream.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choices = json.loads(line[6:])["choices"]
                text += "".join(c["delta"].get("content") or "" for c in choices)
    assert text == want and text
    models = httpx.get(f"{router.url}/v1/models", timeout=30).json()
    assert [m["id"] for m in models["data"]] == ["tiny"]


def test_a_prefill_instance_that_dies(cluster):
    """Its held prompt cannot be pulled: the decode instance fails that request by name (503) within its transfer
    timeout and holds nothing after; the router sends every later request to the other prefill instance."""
    router, narrow, decode = cluster["router"], cluster["narrow"], cluster["decode"]
    first = post(narrow.url, "/v1/completions", prompt=PROMPTS[0], max_tokens=1,
                 kv_transfer_params={"do_remote_decode": True}).json()
    narrow.stop()
    failed = post(decode.url, "/v1/completions", prompt=PROMPTS[0], max_tokens=8,
                  kv_transfer_params=first["kv_transfer_params"])
    assert failed.status_code == 503 and "could not be pulled from the prefill instance" in failed.text
    assert kv_usage(decode) == 0.0
    for prompt in PROMPTS:
        assert_same_completion(complete(router.url, prompt), complete(decode.url, prompt))
    body = health(router).json()
    assert body["status"] == "ok"
    assert [i["healthy"] for i in body["prefill"]] == [True, False] and body["prefill"][1]["problem"]


def test_the_decode_instance_that_dies(cluster):
    """The request ends with a 503 naming the decode instance; /health answers 503 while none can serve; the
    prefill instance frees the prompt's blocks at its abort timeout."""
    router, wide, decode = cluster["router"], cluster["wide"], cluster["decode"]
    decode.stop()
    response = post(router.url, "/v1/completions", prompt=PROMPTS[2], max_tokens=8)
    assert response.status_code == 503, response.text
    assert f"no decode instance could serve the request: {decode.url}: ConnectError" in response.text
    assert kv_usage(wide) > 0  # the prefilled prompt's blocks, held for a pull that never comes
    down = health(router)
    assert down.status_code == 503 and down.json()["error"]["message"] == "no decode instance can serve"
    deadline = time.monotonic() + ABORT_TIMEOUT_S + 20
    while kv_usage(wide) > 0 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert kv_usage(wide) == 0.0
