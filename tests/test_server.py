"""`cpllm serve` as a real process on loopback, driven by the official openai client and httpx.

Every answer is compared with `LLM.generate` / `LLM.chat` on the same tiny random
model in this process (same engine code, same seeds), so a wrong prompt, wrong
sampling params, lost or duplicated stream deltas or wrong usage all show up.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import openai
import pytest
from tiny_models import save_tiny_hf_model

from cpllm.engine.llm import LLM
from cpllm.engine.sampling_params import SamplingParams
from cpllm.server.formatting import ChoiceCursor, pending_stop_prefix
from cpllm.server.process import ServerProcess

ENGINE_FLAGS = ["--kv-cache-memory-bytes", "4MiB", "--max-model-len", "256", "--block-size", "4"]
PROMPTS = ["hello world", "the cat sat on the mat", "The world is", "hello"]


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> str:
    return save_tiny_hf_model(str(tmp_path_factory.mktemp("tiny_server")))


@pytest.fixture(scope="module")
def server(model_folder):
    with ServerProcess.running([model_folder, *ENGINE_FLAGS]) as server:
        yield server


@pytest.fixture(scope="module")
def llm(model_folder):
    with LLM(model_folder, max_model_len=256, block_size=4, kv_cache_memory_bytes=4 * 2**20) as engine:
        yield engine


@pytest.fixture(scope="module")
def client(server, model_folder):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=60, max_retries=0)


def reference(llm: LLM, prompt, **params):
    return llm.generate(prompt, SamplingParams(**params))[0]


def metric(server: ServerProcess, name: str, **labels) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        match = re.match(r"^(\w+)(\{[^}]*\})? (\S+)$", line)
        if not match or match.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(match.group(3))
    return total


# ---- completions ---------------------------------------------------------------------------------------


def test_models_lists_the_served_model(client, model_folder):
    assert [m.id for m in client.models.list().data] == [model_folder]


def test_completion_greedy_matches_llm_generate(client, llm, model_folder):
    ref = reference(llm, PROMPTS[1], max_tokens=12, temperature=0.0)
    got = client.completions.create(model=model_folder, prompt=PROMPTS[1], max_tokens=12, temperature=0)
    assert got.choices[0].text == ref.outputs[0].text
    assert got.choices[0].finish_reason == ref.outputs[0].finish_reason
    assert got.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert got.usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens


def test_completion_token_id_prompt_n_seeded_is_reproducible(client, llm, model_folder):
    prompt_ids = [5, 70, 120, 33, 250]
    params = dict(n=3, max_tokens=10, temperature=1.0, top_p=0.9, seed=1234, presence_penalty=0.5)
    ref = llm.generate({"prompt_token_ids": prompt_ids}, SamplingParams(**params))[0]
    first = client.completions.create(model=model_folder, prompt=prompt_ids, n=3, max_tokens=10, temperature=1.0,
                                      top_p=0.9, seed=1234, presence_penalty=0.5)
    again = client.completions.create(model=model_folder, prompt=prompt_ids, n=3, max_tokens=10, temperature=1.0,
                                      top_p=0.9, seed=1234, presence_penalty=0.5)
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert texts == [c.text for c in ref.outputs]
    assert [c.text for c in sorted(again.choices, key=lambda c: c.index)] == texts
    assert len(set(texts)) > 1  # three different samples, not one repeated
    assert first.usage.prompt_tokens == len(prompt_ids)
    assert first.usage.completion_tokens == sum(len(c.token_ids) for c in ref.outputs)


def test_completion_vllm_extra_fields(client, llm, model_folder):
    extra = dict(top_k=5, min_p=0.05, repetition_penalty=1.3, ignore_eos=True, stop_token_ids=[7])
    ref = reference(llm, PROMPTS[0], max_tokens=9, temperature=0.8, seed=3, **extra)
    got = client.completions.create(model=model_folder, prompt=PROMPTS[0], max_tokens=9, temperature=0.8, seed=3,
                                    extra_body=extra)
    assert got.choices[0].text == ref.outputs[0].text


def test_completion_batch_of_prompts(client, llm, model_folder):
    refs = llm.generate(PROMPTS[:3], SamplingParams(max_tokens=6, temperature=0.0, n=2))
    got = client.completions.create(model=model_folder, prompt=PROMPTS[:3], max_tokens=6, temperature=0, n=2)
    by_index = {c.index: c.text for c in got.choices}
    assert by_index == {i * 2 + c.index: c.text for i, r in enumerate(refs) for c in r.outputs}
    assert got.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in refs)


def _boundary_stop(llm: LLM, prompt: str) -> str:
    """Two characters of the greedy text that straddle a token boundary, so that a stream sees the
    first one a step before the stop string is complete (what the server must hold back)."""
    out = reference(llm, prompt, max_tokens=24, temperature=0.0, ignore_eos=True).outputs[0]
    full = out.text
    for k in range(len(out.token_ids) // 2, len(out.token_ids)):
        head = llm.tokenizer.decode(out.token_ids[:k])
        cut = len(head)
        if full.startswith(head) and 0 < cut < len(full) - 1 and "\ufffd" not in full[cut - 1 : cut + 1]:
            if full.find(full[cut - 1 : cut + 1]) == cut - 1:
                return full[cut - 1 : cut + 1]
    raise AssertionError(f"no usable stop string in {full!r}")


def test_stop_string_streamed_and_not(client, llm, model_folder):
    stop = _boundary_stop(llm, PROMPTS[2])
    ref = reference(llm, PROMPTS[2], max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop])
    assert ref.outputs[0].finish_reason == "stop" and ref.outputs[0].stop_reason == stop
    got = client.completions.create(model=model_folder, prompt=PROMPTS[2], max_tokens=24, temperature=0,
                                    stop=[stop], extra_body={"ignore_eos": True})
    assert got.choices[0].text == ref.outputs[0].text
    assert got.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=model_folder, prompt=PROMPTS[2], max_tokens=24, temperature=0,
                                            stop=[stop], stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.outputs[0].text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_stream_cursor_holds_back_a_possible_stop_string():
    params = SamplingParams(stop=["XYZ", "ab"])
    cursor = ChoiceCursor()
    assert cursor.advance("hello X", False, params) == "hello "  # "X" may start "XYZ"
    assert cursor.advance("hello XY", False, params) == ""
    assert cursor.advance("hello XYq", False, params) == "XYq"  # not a stop after all
    assert cursor.advance("hello XYqa", False, params) == ""
    assert cursor.advance("hello XYq", True, params) == ""  # the engine cut "ab": nothing more to send
    assert pending_stop_prefix("say XY", ["XYZ"]) == 2 and pending_stop_prefix("say", ["XYZ"]) == 0
    keep = ChoiceCursor()
    assert keep.advance("hello X", False, SamplingParams(stop=["XYZ"], include_stop_str_in_output=True)) == "hello X"


def test_streaming_completion_with_usage(client, llm, model_folder):
    ref = reference(llm, PROMPTS[0], max_tokens=15, temperature=0.7, seed=11, n=2)
    chunks = list(client.completions.create(model=model_folder, prompt=PROMPTS[0], max_tokens=15, temperature=0.7,
                                            seed=11, n=2, stream=True, stream_options={"include_usage": True}))
    texts = {0: "", 1: ""}
    finish = {}
    for chunk in chunks[:-1]:
        assert chunk.usage is None
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason is not None:
                finish[choice.index] = choice.finish_reason
    assert texts == {c.index: c.text for c in ref.outputs}
    assert finish == {c.index: c.finish_reason for c in ref.outputs}
    assert chunks[-1].choices == []
    assert chunks[-1].usage.prompt_tokens == len(ref.prompt_token_ids)
    assert chunks[-1].usage.completion_tokens == sum(len(c.token_ids) for c in ref.outputs)


def test_stream_is_server_sent_events_ending_with_done(server, model_folder):
    body = {"model": model_folder, "prompt": "hello", "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in events)
    assert events[-1] == "data: [DONE]"
    assert all(json.loads(line[6:])["object"] == "text_completion" for line in events[:-1])


def test_completion_logprobs_and_echo(client, llm, model_folder):
    ref = reference(llm, PROMPTS[1], max_tokens=5, temperature=0.0, logprobs=2, prompt_logprobs=2)
    got = client.completions.create(model=model_folder, prompt=PROMPTS[1], max_tokens=5, temperature=0,
                                    logprobs=2, echo=True)
    choice = got.choices[0]
    num_prompt = len(ref.prompt_token_ids)
    assert choice.text == PROMPTS[1] + ref.outputs[0].text
    lp = choice.logprobs
    assert len(lp.tokens) == num_prompt + 5
    assert lp.token_logprobs[0] is None  # nothing predicts the first prompt token
    expected_prompt = [p[t].logprob for p, t in zip(ref.prompt_logprobs[1:], ref.prompt_token_ids[1:])]
    expected_out = [p[t].logprob for p, t in zip(ref.outputs[0].logprobs, ref.outputs[0].token_ids)]
    assert lp.token_logprobs[1:] == pytest.approx(expected_prompt + expected_out, abs=1e-5)
    assert all(len(top) >= 2 for top in lp.top_logprobs[num_prompt:])
    # greedy: the sampled token is the best of its top alternatives
    for token_lp, top in zip(lp.token_logprobs[num_prompt:], lp.top_logprobs[num_prompt:]):
        assert token_lp == pytest.approx(max(top.values()), abs=1e-6)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[num_prompt] == len(PROMPTS[1])


# ---- chat ----------------------------------------------------------------------------------------------

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]


def test_chat_matches_llm_chat(client, llm, model_folder):
    ref = llm.chat(MESSAGES, SamplingParams(max_tokens=10, temperature=0.0))[0]
    got = client.chat.completions.create(model=model_folder, messages=MESSAGES, max_tokens=10, temperature=0)
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == ref.outputs[0].text
    assert got.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert got.usage.completion_tokens == len(ref.outputs[0].token_ids)
    streamed = client.chat.completions.create(model=model_folder, messages=MESSAGES, max_completion_tokens=10,
                                              temperature=0, stream=True)
    chunks = list(streamed)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.outputs[0].text
    assert chunks[-1].choices[0].finish_reason == ref.outputs[0].finish_reason


def test_chat_seeded_n_and_logprobs(client, llm, model_folder):
    ref = llm.chat(MESSAGES, SamplingParams(max_tokens=6, temperature=1.0, seed=99, n=2, logprobs=3))[0]
    got = client.chat.completions.create(model=model_folder, messages=MESSAGES, max_tokens=6, temperature=1.0,
                                         seed=99, n=2, logprobs=True, top_logprobs=3)
    for choice, expected in zip(sorted(got.choices, key=lambda c: c.index), ref.outputs):
        assert choice.message.content == expected.text
        content = choice.logprobs.content
        assert len(content) == len(expected.token_ids)
        assert [c.logprob for c in content] == pytest.approx(
            [p[t].logprob for p, t in zip(expected.logprobs, expected.token_ids)], abs=1e-5)
        assert all(len(c.top_logprobs) == 3 for c in content)
        assert all(c.top_logprobs[0].logprob >= c.top_logprobs[-1].logprob for c in content)


# ---- load, metrics, disconnect ------------------------------------------------------------------------


def test_32_concurrent_streams_complete_and_are_counted(server, llm, model_folder):
    prompts = [f"{PROMPTS[i % 4]} {i}" for i in range(32)]
    refs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    before = metric(server, "cpllm_request_success_total")
    before_tokens = metric(server, "cpllm_generation_tokens_total")

    async def one(client: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await client.completions.create(model=model_folder, prompt=prompt, max_tokens=16, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        return "".join([chunk.choices[0].text async for chunk in stream])

    async def run_all() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", timeout=120, max_retries=0) as c:
            return await asyncio.gather(*(one(c, p) for p in prompts))

    texts = asyncio.run(run_all())
    assert texts == [r.outputs[0].text for r in refs]
    assert metric(server, "cpllm_request_success_total") - before == 32
    assert metric(server, "cpllm_generation_tokens_total") - before_tokens == 32 * 16
    assert metric(server, "cpllm_time_to_first_token_seconds_count") >= 32
    assert metric(server, "cpllm_http_requests_total", route="/v1/completions", status="200") >= 32


def test_disconnect_mid_stream_frees_kv_blocks(server, model_folder):
    assert metric(server, "cpllm_kv_cache_usage_perc", rank="0") == 0.0
    aborted_before = metric(server, "cpllm_request_success_total", finished_reason="abort")
    # 16 sequences of 240 tokens take seconds on this engine; the client leaves after a few chunks
    body = {"model": model_folder, "prompt": PROMPTS[1], "max_tokens": 240, "ignore_eos": True, "stream": True,
            "n": 16}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        for _ in range(6):  # some tokens are out: the request holds KV blocks now
            next(lines)
        assert metric(server, "cpllm_kv_cache_usage_perc", rank="0") > 0.0
    # the connection is closed: the server must abort the request and free its blocks
    deadline = time.monotonic() + 30
    while metric(server, "cpllm_kv_cache_usage_perc", rank="0") != 0.0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metric(server, "cpllm_kv_cache_usage_perc", rank="0") == 0.0
    assert metric(server, "cpllm_num_requests_running") == 0.0
    assert metric(server, "cpllm_request_success_total", finished_reason="abort") == aborted_before + 16


def test_health_and_metrics_names(server):
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    for name in ("cpllm_time_to_first_token_seconds", "cpllm_time_per_output_token_seconds",
                 "cpllm_e2e_request_latency_seconds", "cpllm_num_requests_running", "cpllm_num_requests_waiting",
                 "cpllm_kv_cache_usage_perc", "cpllm_prompt_tokens_total", "cpllm_generation_tokens_total",
                 "cpllm_http_requests_total"):
        assert name in text


def test_request_log_line(server):
    log = server.log()
    line = next(line for line in log.splitlines() if "request cmpl-" in line)
    assert re.search(r"request cmpl-\w+ status=200 prompt_tokens=\d+ output_tokens=\d+ ttft=[\d.]+s latency=[\d.]+s",
                     line)
