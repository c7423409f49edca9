"""Disaggregated prefill/decode through two `cpllm serve` processes, as vLLM's proxy drives them: the prefill
server gets the request with `kv_transfer_params: {"do_remote_decode": true}` and max_tokens 1 and answers with
the blocks' whereabouts; the decode server gets the original request with those params, pulls the prompt's K/V
(a PCP = 2 producer, interleave 2 and block size 4 -> a TP = 2 x DCP = 2 consumer, block size 8, one KV head:
both sides multi-rank, each rank of the consumer pulling from both producer ranks) and must answer what it answers
without them (which the layout tests hold to the single rank's)."""

from __future__ import annotations

import json

import httpx
import pytest
from test_disagg_engine import free_ports
from tiny_models import save_tiny_hf_model

from cpllm.server.process import ServerProcess
from parallel_helpers import random_prompt

FLAGS = ["--kv-cache-memory-bytes", "1MiB", "--max-model-len", "128", "--served-model-name", "tiny",
         "--threads-per-rank", "1"]
PROMPT = random_prompt(21, seed=21)


def kv_flag(role: str, port: int) -> list[str]:
    return ["--kv-transfer-config", json.dumps({"kv_connector": "CpllmConnector", "kv_role": role,
                                                 "kv_ip": "127.0.0.1", "kv_port": port})]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    folder = save_tiny_hf_model(str(tmp_path_factory.mktemp("tiny_disagg")), seed=5, num_key_value_heads=1)
    producer = [folder, *FLAGS, "-pcp", "2", "--cp-kv-cache-interleave-size", "2", "--block-size", "4",
                *kv_flag("kv_producer", free_ports(3))]
    consumer = [folder, *FLAGS, "-tp", "2", "-dcp", "2", "--block-size", "8", "--no-enable-prefix-caching",
                *kv_flag("kv_consumer", free_ports(3))]
    with ServerProcess.running(producer, timeout_s=300) as p, ServerProcess.running(consumer, timeout_s=300) as c:
        yield p, c


def complete(server, **fields) -> dict:
    body = {"model": "tiny", "prompt": PROMPT, "temperature": 0, "logprobs": 1, "ignore_eos": True, **fields}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_proxy_flow_equals_the_decode_server_alone(servers):
    producer, consumer = servers
    first = complete(producer, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    params = first["kv_transfer_params"]
    assert params["do_remote_prefill"] and params["remote_block_ids"] and params["remote_port"]
    got = complete(consumer, max_tokens=8, kv_transfer_params=params)
    want = complete(consumer, max_tokens=8)
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    assert first["choices"][0]["text"] == want["choices"][0]["logprobs"]["tokens"][0]
    a, b = got["choices"][0]["logprobs"]["token_logprobs"], want["choices"][0]["logprobs"]["token_logprobs"]
    assert max(abs(x - y) for x, y in zip(a, b, strict=True)) <= 1e-4
    assert "kv_transfer_params" not in want


def test_several_prompts_with_kv_transfer_params_are_refused(servers):
    producer, _ = servers
    response = httpx.post(f"{producer.url}/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": [PROMPT, PROMPT], "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    assert response.status_code == 400 and "one prompt per request" in response.text


def chat(server, **fields) -> dict:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}], "temperature": 0,
            "logprobs": True, "ignore_eos": True, **fields}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_chat_through_both_servers(servers):
    """The decode server applies the chat template again: the same prompt tokens as the prefill server's."""
    producer, consumer = servers
    first = chat(producer, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    got = chat(consumer, max_tokens=6, kv_transfer_params=first["kv_transfer_params"])
    want = chat(consumer, max_tokens=6)
    assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
    a = [t["logprob"] for t in got["choices"][0]["logprobs"]["content"]]
    b = [t["logprob"] for t in want["choices"][0]["logprobs"]["content"]]
    assert len(a) == 6 and max(abs(x - y) for x, y in zip(a, b, strict=True)) <= 1e-4
