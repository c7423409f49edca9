"""What vLLM's own server tests check that cpllm had not built (issue 42), against a real `cpllm serve` on the tiny
random model: null for fields not asked for, /v1/chat/completions/batch, /invocations, /load, prefix-cache hits in
usage, continuous usage in streams, truncation_side, whole-vocabulary logprobs, logprob_token_ids, streamed token
ids, chat token-in and --root-path. The model's text is random: tests compare token ids and shapes, and runs of
the same greedy request against each other."""

from __future__ import annotations

import json
import re
import socket
import time
import uuid

import httpx
import jsonschema
import openai
import pytest
import torch
from tiny_models import save_tiny_hf_model, tiny_hf_tokenizer

from cpllm.cli import build_parser
from cpllm.server.errors import APIError
from cpllm.server.launcher import serve_engine_kwargs
from cpllm.server.options import ServeOptions, serve_options
from cpllm.server.process import ServerProcess
from cpllm.server.prompt_fields import resolve_logprobs
from cpllm.server.protocol import CompletionRequest
from cpllm.server.reasoning import split_reasoning
from cpllm.server.stream_usage import StreamUsage
from cpllm.worker.kv_cache import available_memory_bytes

BLOCK = 4
FLAGS = ["--kv-cache-memory-bytes", "8MiB", "--max-model-len", "256", "--block-size", str(BLOCK),
         "--served-model-name", "tiny", "--enable-prompt-tokens-details", "--enable-server-load-tracking",
         "--max-logprobs", "-1", "--root-path", "/llm", "--dtype", "float", "--trust-remote-code",
         "--disable-frontend-multiprocessing", "--enable-log-requests", "--load-format", "safetensors",
         "--reasoning-parser", "qwen3", "--enable-per-request-metrics"]
MARK = "SERVER-TEMPLATE "
TEMPLATE = (MARK + "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MODEL = "tiny"
ASK = [{"role": "user", "content": "hello there"}]
VOCAB = 300  # tiny_models' vocabulary


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = save_tiny_hf_model(str(tmp_path_factory.mktemp("tiny_vllm_compat")))
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    with ServerProcess.running([folder, *FLAGS, "--chat-template", str(template)]) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=60, max_retries=0)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def post(http, path: str, **body) -> dict:
    response = http.post(path, json={"model": MODEL, **body})
    assert response.status_code == 200, response.text
    return response.json()


def error_param(response: httpx.Response) -> str:
    assert response.status_code == 400, response.text
    return response.json()["error"]["param"]


def events(http, path: str, **body) -> list[dict]:
    with http.stream("POST", path, json={"model": MODEL, "stream": True, **body}) as response:
        assert response.status_code == 200, response.read()
        lines = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


# ---- fields vLLM sends as null ---------------------------------------------------------------------------


def test_fields_not_asked_for_are_null(http, client):
    choice = post(http, "/v1/completions", prompt="the cat", max_tokens=2)["choices"][0]
    assert {k: choice[k] for k in ("prompt_logprobs", "prompt_token_ids", "token_ids")} == dict.fromkeys(
        ("prompt_logprobs", "prompt_token_ids", "token_ids"))
    reply = post(http, "/v1/chat/completions", messages=ASK, max_tokens=2)
    assert reply["prompt_logprobs"] is None and reply["prompt_token_ids"] is None
    assert reply["choices"][0]["token_ids"] is None
    typed = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2)
    assert typed.prompt_logprobs is None and typed.choices[0].token_ids is None  # attributes, not AttributeError


# ---- /v1/chat/completions/batch, /invocations, /load ------------------------------------------------------


def test_batch_answers_each_conversation_as_its_own_request(http):
    conversations = [[{"role": "user", "content": "say yes"}], [{"role": "user", "content": "say something else"}]]
    fields = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    batch = post(http, "/v1/chat/completions/batch", messages=conversations, **fields)
    singles = [post(http, "/v1/chat/completions", messages=m, **fields) for m in conversations]
    assert [c["index"] for c in batch["choices"]] == [0, 1]
    assert [c["message"]["content"] for c in batch["choices"]] == [s["choices"][0]["message"]["content"]
                                                                  for s in singles]
    assert batch["usage"]["prompt_tokens"] == sum(s["usage"]["prompt_tokens"] for s in singles)
    assert batch["usage"]["completion_tokens"] == 12
    choices = post(http, "/v1/chat/completions/batch", messages=conversations, max_tokens=4,
                   guided_choice=["yes", "no"])["choices"]
    assert {c["message"]["content"] for c in choices} <= {"yes", "no"}


def test_batch_token_ids_and_logprob_spelling(http):
    conversations = [[{"role": "user", "content": "say yes"}], [{"role": "user", "content": "say something else"}]]
    fields = {"max_tokens": 4, "temperature": 0, "ignore_eos": True, "logprobs": True, "top_logprobs": 1}
    batch = post(http, "/v1/chat/completions/batch", messages=conversations, return_token_ids=True, **fields)
    singles = [post(http, "/v1/chat/completions", messages=m, return_token_ids=True, **fields) for m in conversations]
    assert [c["token_ids"] for c in batch["choices"]] == [s["choices"][0]["token_ids"] for s in singles]
    assert all(len(c["token_ids"]) == 4 for c in batch["choices"]) and batch["prompt_token_ids"] is None
    # return_token_ids alone leaves the tokens spelled as text; return_tokens_as_token_ids spells them as ids
    texts = [e["token"] for c in batch["choices"] for e in c["logprobs"]["content"]]
    assert texts == [e["token"] for s in singles for e in s["choices"][0]["logprobs"]["content"]]
    spelled = post(http, "/v1/chat/completions/batch", messages=conversations, return_tokens_as_token_ids=True,
                   **fields)
    assert [[e["token"] for e in c["logprobs"]["content"]] for c in spelled["choices"]] == \
        [[f"token_id:{t}" for t in c["token_ids"]] for c in batch["choices"]]
    assert all(c["token_ids"] is None for c in spelled["choices"])


def test_batch_refusals_name_the_conversation(http):
    bad = [ASK, [{"role": "user"}]]
    assert error_param(http.post("/v1/chat/completions/batch", json={"messages": bad})) == "messages.1.0.content"
    assert error_param(http.post("/v1/chat/completions/batch", json={"messages": [ASK], "stream": True})) == "stream"
    assert error_param(http.post("/v1/chat/completions/batch", json={"messages": []})) == "messages"


def test_invocations_routes_by_body(http):
    completion = {"prompt": "the cat sat", "max_tokens": 5, "temperature": 0}
    chat = {"messages": ASK, "max_tokens": 5, "temperature": 0}
    for path, body in (("/v1/completions", completion), ("/v1/chat/completions", chat)):
        direct, invoked = post(http, path, **body), post(http, "/invocations", **body)
        assert invoked["object"] == direct["object"]
        assert invoked["choices"] == direct["choices"] and invoked["usage"]["prompt_tokens"] == \
            direct["usage"]["prompt_tokens"]
    assert error_param(http.post("/invocations", json={"input": "x"})) == "messages"


def _load(http) -> int:
    response = http.get("/load")
    assert response.status_code == 200, response.text
    return response.json()["server_load"]


def test_server_load_counts_requests_in_flight(server, http):
    assert _load(http) == 0
    body = json.dumps({"model": MODEL, "prompt": "a story", "max_tokens": 4}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as conn:
        conn.sendall(head + body[:10])  # arrived, its body not yet complete: in flight until answered
        assert _poll(lambda: _load(http) == 1)
        conn.sendall(body[10:])
        answer = b"".join(iter(lambda: conn.recv(65536), b""))
    assert answer.startswith(b"HTTP/1.1 200") and b'"text_completion"' in answer
    assert _poll(lambda: _load(http) == 0)


def _poll(condition, tries: int = 200) -> bool:
    """True once `condition()` holds (the server counts on its event loop, a moment after the socket moved)."""
    for _ in range(tries):
        if condition():
            return True
        time.sleep(0.01)
    return False


# ---- usage ---------------------------------------------------------------------------------------------


def test_prefix_cache_hits_in_usage(http):
    prompt = f"unique {uuid.uuid4().hex} prompt that spans blocks"
    first = post(http, "/v1/completions", prompt=prompt, max_tokens=2)["usage"]
    again = post(http, "/v1/completions", prompt=prompt, max_tokens=2)["usage"]
    assert first["prompt_tokens_details"] == {"cached_tokens": 0} and first["cache_read_input_tokens"] == 0
    hit = BLOCK * ((again["prompt_tokens"] - 1) // BLOCK)  # every full block but the one holding the last token
    assert again["prompt_tokens_details"] == {"cached_tokens": hit} and again["cache_read_input_tokens"] == hit > 0
    streamed = events(http, "/v1/completions", prompt=prompt, max_tokens=2, stream_options={"include_usage": True})
    assert streamed[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": hit}


def test_continuous_usage_stats(http):
    chunks = events(http, "/v1/chat/completions", messages=ASK, max_tokens=6, ignore_eos=True,
                    stream_options={"include_usage": True, "continuous_usage_stats": True})
    assert all(c["usage"] is not None for c in chunks)
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == 6
    assert len({c["usage"]["prompt_tokens"] for c in chunks}) == 1
    plain = events(http, "/v1/chat/completions", messages=ASK, max_tokens=2, stream_options={"include_usage": True})
    assert all(c["usage"] is None for c in plain[:-1]) and plain[-1]["usage"]["completion_tokens"] == 2


def test_force_include_usage_makes_every_stream_continuous():
    req = CompletionRequest(prompt="x", stream=True)
    forced = StreamUsage.of(req, ServeOptions(enable_force_include_usage=True), 3)
    assert forced.final and forced.continuous
    plain = StreamUsage.of(req, ServeOptions(), 3)
    assert not plain.final and not plain.continuous and plain.chunk_fields([]) == {}


# ---- request fields ------------------------------------------------------------------------------------


def test_truncation_side(http):
    full = tiny_hf_tokenizer().encode("the cat sat on the mat")
    for side, kept in (("left", full[-3:]), ("right", full[:3]), (None, full[-3:])):
        body = {"truncation_side": side} if side else {}
        choice = post(http, "/v1/completions", prompt="the cat sat on the mat", max_tokens=1,
                      truncate_prompt_tokens=3, return_token_ids=True, **body)["choices"][0]
        assert choice["prompt_token_ids"] == kept, side


def test_minus_one_is_the_whole_vocabulary(http):
    choice = post(http, "/v1/completions", prompt="the cat sat", max_tokens=1, prompt_logprobs=-1,
                  logprobs=-1, return_tokens_as_token_ids=True)["choices"][0]  # text keys would merge byte tokens
    assert all(len(position) == VOCAB for position in choice["prompt_logprobs"][1:])
    assert len(choice["logprobs"]["top_logprobs"][0]) == VOCAB
    reply = post(http, "/v1/chat/completions", messages=ASK, max_tokens=1, logprobs=True, top_logprobs=-1)
    top = reply["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    assert len(top) == VOCAB and top == sorted(top, key=lambda e: -e["logprob"])


def test_max_logprobs_bounds_requests():
    assert resolve_logprobs(-1, "top_logprobs", -1, VOCAB) == VOCAB
    assert resolve_logprobs(20, "top_logprobs", 20, VOCAB) == 20
    for value in (21, -1):
        with pytest.raises(APIError) as info:
            resolve_logprobs(value, "top_logprobs", 20, VOCAB)
        assert info.value.status == 400 and info.value.param == "top_logprobs"
        assert "--max-logprobs 20" in info.value.message


def test_logprob_token_ids_report_the_named_tokens(http):
    named = [100, 150, 200]
    body = {"messages": ASK, "max_tokens": 3, "temperature": 0, "logprobs": True, "return_tokens_as_token_ids": True}
    pinned = post(http, "/v1/chat/completions", **body, top_logprobs=3, logprob_token_ids=named)
    whole = post(http, "/v1/chat/completions", **body, top_logprobs=-1)
    for got, every in zip(pinned["choices"][0]["logprobs"]["content"], whole["choices"][0]["logprobs"]["content"]):
        assert got["token"] == every["token"]
        reference = {e["token"]: e["logprob"] for e in every["top_logprobs"]}
        # as vLLM: the sampled token first, then the named ones (each once), whatever top_logprobs says
        assert [e["token"] for e in got["top_logprobs"]] == list(dict.fromkeys(
            [got["token"], *(f"token_id:{t}" for t in named)]))
        assert all(e["logprob"] == pytest.approx(reference[e["token"]], abs=1e-5) for e in got["top_logprobs"])
    assert error_param(http.post("/v1/chat/completions", json={**body, "logprob_token_ids": [VOCAB]})) == \
        "logprob_token_ids"
    for bad in ({"messages": ASK, "logprob_token_ids": [1]}, {**body, "logprob_token_ids": []}):
        assert error_param(http.post("/v1/chat/completions", json=bad)) == "logprob_token_ids"


def test_return_token_ids_streamed(http):
    body = {"max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    whole = post(http, "/v1/completions", prompt="the cat", **body)["choices"][0]
    chunks = events(http, "/v1/completions", prompt="the cat", logprobs=0, return_tokens_as_token_ids=True, **body)
    assert chunks[0]["choices"][0]["prompt_token_ids"] == whole["prompt_token_ids"]
    streamed = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    spelled = [int(t.removeprefix("token_id:")) for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    assert streamed == spelled == whole["token_ids"]
    reply = post(http, "/v1/chat/completions", messages=ASK, **body)
    chat = events(http, "/v1/chat/completions", messages=ASK, **body)
    assert chat[0]["prompt_token_ids"] == reply["prompt_token_ids"]
    assert all("prompt_token_ids" not in c for c in chat[1:])
    assert [t for c in chat for t in c["choices"][0]["token_ids"]] == reply["choices"][0]["token_ids"]


def test_chat_token_in(http):
    ids = post(http, "/tokenize", messages=ASK)["tokens"]
    fields = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    rendered = post(http, "/v1/chat/completions", messages=ASK, **fields)
    token_in = post(http, "/v1/chat/completions", messages=[], prompt_token_ids=ids, return_token_ids=True, **fields)
    assert token_in["prompt_token_ids"] == ids
    assert token_in["choices"][0]["message"]["content"] == rendered["choices"][0]["message"]["content"]
    refuse = {"messages": [], "prompt_token_ids": ids}
    assert error_param(http.post("/v1/chat/completions", json={**refuse, "add_generation_prompt": True})) == \
        "add_generation_prompt"
    assert error_param(http.post("/v1/chat/completions", json={**refuse, "messages": ASK})) == "messages"
    assert error_param(http.post("/v1/chat/completions", json={"messages": []})) == "messages"
    assert error_param(http.post("/v1/chat/completions", json={**refuse, "prompt_token_ids": [VOCAB]})) == \
        "prompt_token_ids"


# ---- server flags --------------------------------------------------------------------------------------


def test_root_path_serves_both_forms(server):
    for base in (f"{server.url}/llm/v1", f"{server.url}/v1"):
        client = openai.OpenAI(base_url=base, api_key="unused", timeout=60, max_retries=0)
        assert client.models.list().data[0].id == MODEL
        assert client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2).choices
    assert httpx.get(f"{server.url}/llm/health", timeout=10).status_code == 200


def test_server_chat_template_and_request_logs(server, http):
    tokenizer = tiny_hf_tokenizer()
    reply = post(http, "/v1/chat/completions", messages=ASK, max_tokens=1, return_token_ids=True)
    assert tokenizer.decode(reply["prompt_token_ids"]).startswith(MARK)  # the file given to --chat-template
    own = post(http, "/v1/chat/completions", messages=ASK, max_tokens=1, return_token_ids=True,
               chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert tokenizer.decode(own["prompt_token_ids"]) == "hello there"  # a request's own template wins
    assert f"received request {reply['id']}: 1 prompt(s)" in server.log()  # --enable-log-requests


def test_custom_role_reaches_the_template(http):
    tokenizer = tiny_hf_tokenizer()
    body = {"max_tokens": 1, "return_token_ids": True}
    text = post(http, "/v1/chat/completions", messages=[{"role": "my-custom-role", "content": "what is 1+1?"}],
                **body)
    parts = post(http, "/v1/chat/completions", messages=[{"role": "my-custom-role", "content": [
        {"type": "text", "text": "what is 1+1?"}]}], **body)
    rendered = MARK + "<|im_start|>my-custom-role\nwhat is 1+1?<|im_end|>\n<|im_start|>assistant\n"  # as vLLM passes it
    assert tokenizer.decode(text["prompt_token_ids"]) == rendered
    assert parts["prompt_token_ids"] == text["prompt_token_ids"]
    assert error_param(http.post("/v1/chat/completions", json={"messages": [{"role": "", "content": "x"}]})) == \
        "messages.0.role"
    assert error_param(http.post("/v1/chat/completions", json={"messages": [{"role": "my-role"}]})) == \
        "messages.0.content"


TIMINGS = {"queue_time_ms", "time_to_first_token_ms", "generation_time_ms", "mean_itl_ms", "tokens_per_second"}


def test_per_request_metrics(http):
    body = {"messages": ASK, "max_tokens": 4, "ignore_eos": True}
    start = time.monotonic()
    metrics = post(http, "/v1/chat/completions", **body)["metrics"]
    elapsed_ms = (time.monotonic() - start) * 1000
    assert set(metrics) == TIMINGS and all(v >= 0 for v in metrics.values())
    # the engine's timestamps lie inside the request's life as the client saw it, and agree with each other
    assert metrics["queue_time_ms"] + metrics["time_to_first_token_ms"] + metrics["generation_time_ms"] <= elapsed_ms
    assert metrics["mean_itl_ms"] == pytest.approx(metrics["generation_time_ms"] / 3)
    inference_s = (metrics["time_to_first_token_ms"] + metrics["generation_time_ms"]) / 1000
    assert metrics["tokens_per_second"] == pytest.approx(4 / inference_s, rel=1e-6)
    assert set(post(http, "/v1/completions", prompt="the cat", max_tokens=3, ignore_eos=True)["metrics"]) == TIMINGS
    assert "metrics" not in post(http, "/v1/chat/completions", **body, n=2)  # two sequences' timings: left out
    chunks = events(http, "/v1/chat/completions", **{**body, "max_tokens": 1},
                    stream_options={"include_usage": True})
    assert all("metrics" not in c for c in chunks[:-1]) and chunks[-1]["choices"] == []
    assert set(chunks[-1]["metrics"]) == TIMINGS - {"mean_itl_ms"}  # one token: no gap between tokens
    streamed = events(http, "/v1/completions", prompt="the cat", max_tokens=2, stream_options={"include_usage": True})
    assert set(streamed[-1]["metrics"]) == TIMINGS


def test_forwarded_prompt_ids_replace_the_messages(http):
    """vLLM's router forwards the prefill stage's prompt ids in kv_transfer_params; the chat route uses them."""
    body = {"max_tokens": 5, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    baseline = post(http, "/v1/chat/completions", messages=ASK, **body)
    forwarded = {"kv_transfer_params": {"prompt_token_ids": baseline["prompt_token_ids"]}}
    other = [{"role": "user", "content": "unrelated decode-side text"}]
    decode = post(http, "/v1/chat/completions", messages=other, **body, **forwarded)
    assert decode["prompt_token_ids"] == baseline["prompt_token_ids"]
    assert decode["choices"][0]["token_ids"] == baseline["choices"][0]["token_ids"]
    chunks = events(http, "/v1/chat/completions", messages=other, **body, **forwarded)
    assert chunks[0]["prompt_token_ids"] == baseline["prompt_token_ids"]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == baseline["choices"][0]["token_ids"]
    param = "kv_transfer_params.prompt_token_ids"
    for bad in ([], [1, True], [VOCAB], "1 2"):
        fields = {"messages": other, "kv_transfer_params": {"prompt_token_ids": bad}}
        assert error_param(http.post("/v1/chat/completions", json=fields)) == param
    assert error_param(http.post("/v1/chat/completions/batch", json={"messages": [other], **forwarded})) == param


@pytest.mark.parametrize("flags, named", [
    (["--reasoning-parser", "granite"], "--reasoning-parser"),
    (["--api-server-count", "0"], "--api-server-count"),
    (["--load-format", "dummy"], "--load-format"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
    (["--chat-template", "no-such-file"], "--chat-template"),
])  # fmt: skip
def test_vllm_flags_refused_by_name(flags, named):
    args = build_parser().parse_args(["serve", *flags])
    with pytest.raises(ValueError, match=named):
        serve_options(args)


def test_vllm_engine_flags():
    args = build_parser().parse_args(["serve", "model-dir", "--dtype", "half", "--gpu-memory-utilization", "0.25"])
    assert args.dtype == "float16"
    assert [build_parser().parse_args(["serve", "--dtype", d]).dtype for d in ("auto", "float", "bfloat16")] == \
        ["float32", "float32", "bfloat16"]
    options = serve_options(args)
    kv = serve_engine_kwargs(args, options)["kv_cache_memory_bytes"]
    assert kv == pytest.approx(0.25 * available_memory_bytes(torch.device("cpu")), rel=0.05)
    with pytest.raises(ValueError, match="not both"):
        serve_engine_kwargs(build_parser().parse_args(["serve", "--gpu-memory-utilization", "0.2",
                                                  "--kv-cache-memory-bytes", "1MiB"]), options)
    gguf = build_parser().parse_args(["serve", "model-dir", "--load-format", "gguf"])
    with pytest.raises(ValueError, match="--load-format gguf does not match"):
        serve_engine_kwargs(gguf, serve_options(gguf))


# ---- reasoning parsers ---------------------------------------------------------------------------------

THOUGHT = "<think>two and two</think>four"


def test_reasoning_split_whole_and_streamed(http):
    body = {"messages": ASK, "max_tokens": 60, "guided_regex": re.escape(THOUGHT)}
    message = post(http, "/v1/chat/completions", **body)["choices"][0]["message"]
    assert (message["reasoning"], message["reasoning_content"], message["content"]) == ("two and two",) * 2 + ("four",)
    chunks = events(http, "/v1/chat/completions", **body)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning") or "" for d in deltas) == "two and two"
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "two and two"
    assert "".join(d.get("content") or "" for d in deltas) == "four"
    dropped = post(http, "/v1/chat/completions", **body, include_reasoning=False)["choices"][0]["message"]
    assert dropped["reasoning"] is None and dropped["content"] == "four"
    plain = post(http, "/v1/chat/completions", messages=ASK, max_tokens=40, guided_regex="four")
    assert plain["choices"][0]["message"]["reasoning"] is None  # no <think>: all content (qwen3)
    assert plain["choices"][0]["message"]["content"] == "four"


@pytest.mark.parametrize("text, in_thinking, finished, reasoning, content_start", [
    ("two</think>four", True, True, "two", 11),   # deepseek_r1: the prompt opened the thinking
    ("two", True, True, "two", None),              # still thinking when it ended
    ("two</th", True, False, "two", None),         # a tag on its way is held back while streaming
    ("<think>a</think>b", True, False, "a", 16),   # a tag the prompt already opened is dropped
    ("<th", False, False, None, None),             # qwen3: could still become <think>
    ("<th", False, True, None, 0),
    ("plain", False, False, None, 0),
])  # fmt: skip
def test_split_reasoning(text, in_thinking, finished, reasoning, content_start):
    split = split_reasoning(text, in_thinking=in_thinking, finished=finished)
    assert (split.reasoning, split.content_start) == (reasoning, content_start)


# ---- beam search ---------------------------------------------------------------------------------------


def _next_logprobs(http, ids: list[int]) -> dict[int, float]:
    """The model's logprob of every next token after `ids` (a whole-vocabulary request)."""
    top = post(http, "/v1/completions", prompt=ids, max_tokens=1, logprobs=-1,
               return_tokens_as_token_ids=True)["choices"][0]["logprobs"]["top_logprobs"][0]
    return {int(t.removeprefix("token_id:")): lp for t, lp in top.items()}


def test_beam_search_matches_a_search_by_hand(http):
    ids = tiny_hf_tokenizer().encode("the cat")
    out = post(http, "/v1/completions", prompt=[ids, ids], n=2, max_tokens=2, temperature=0, ignore_eos=True,
               use_beam_search=True, return_token_ids=True)
    got = [c["token_ids"] for c in out["choices"]]
    assert len(got) == 4 and got[0] != got[1] and got[:2] == got[2:]  # two beams; same prompt, same beams
    first = _next_logprobs(http, ids)
    kept = sorted(first, key=first.get, reverse=True)[:2]  # step 1: the two best tokens
    paths = {(a, b): first[a] + lp for a in kept for b, lp in _next_logprobs(http, [*ids, a]).items()}
    assert got[:2] == [list(p) for p in sorted(paths, key=paths.get, reverse=True)[:2]]
    assert all(c["finish_reason"] == "length" for c in out["choices"]) and out["usage"]["completion_tokens"] == 8


def test_beam_search_chat_and_refusals(http):
    reply = post(http, "/v1/chat/completions", messages=ASK, n=2, max_tokens=3, ignore_eos=True,
                 use_beam_search=True, length_penalty=0.5, return_token_ids=True)
    beams = [c["token_ids"] for c in reply["choices"]]
    assert len(beams) == 2 and beams[0] != beams[1] and all(len(b) == 3 for b in beams)
    base = {"prompt": "hi", "max_tokens": 2, "use_beam_search": True, "n": 2}
    for extra, param in (({"stream": True}, "use_beam_search"), ({"n": 1}, "use_beam_search"),
                         ({"logprobs": 1}, "logprobs"), ({"stop": ["x"]}, "stop")):
        assert error_param(http.post("/v1/completions", json={**base, **extra})) == param
    assert error_param(http.post("/v1/completions", json={"prompt": "hi", "length_penalty": 2.0})) == \
        "length_penalty"


def test_echo_of_token_ids_keeps_special_tokens(http):
    ids = [1, *tiny_hf_tokenizer().encode("hi", add_special_tokens=False)]  # <|im_start|> first
    choice = post(http, "/v1/completions", prompt=ids, max_tokens=1, echo=True)["choices"][0]
    assert choice["text"].startswith("<|im_start|>hi")


@pytest.mark.parametrize("fields, param, named", [
    ({"seed": 2**63}, "seed", "less_than_equal"),
    ({"seed": -(2**63) - 1}, "seed", "greater_than_equal"),
    ({"stop_token_ids": [5, VOCAB + 1]}, "stop_token_ids", str(VOCAB + 1)),
    ({"logit_bias": {"bad1": 1.0, "bad2": 2.0}}, "logit_bias", "'bad2'"),
])  # fmt: skip
def test_vllm_validation(http, fields, param, named):
    response = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 1, **fields})
    assert error_param(response) == param
    assert named is None or named in response.json()["error"]["message"]


CAR_TOOL = {"type": "function", "function": {"name": "set_car", "parameters": {
    "$defs": {"CarType": {"enum": ["sedan", "SUV"]}, "Car": {"type": "object", "properties": {
        "kind": {"$ref": "#/$defs/CarType"}}, "required": ["kind"]}},
    "type": "object", "properties": {"car": {"$ref": "#/$defs/Car"}}, "required": ["car"]}}}


def test_required_tool_call_with_its_own_defs(http):
    reply = post(http, "/v1/chat/completions", messages=ASK, tools=[CAR_TOOL], tool_choice="required",
                 max_tokens=120, temperature=0, parallel_tool_calls=False)
    calls = reply["choices"][0]["message"].get("tool_calls")
    assert calls, reply
    assert calls and reply["choices"][0]["finish_reason"] == "tool_calls"
    for call in calls:
        assert call["function"]["name"] == "set_car"
        jsonschema.validate(json.loads(call["function"]["arguments"]), CAR_TOOL["function"]["parameters"])


def test_named_call_cut_short_has_no_tool_calls(http):
    reply = post(http, "/v1/chat/completions", messages=ASK, tools=[CAR_TOOL], max_tokens=2,
                 tool_choice={"type": "function", "function": {"name": "set_car"}})
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "length" and not choice["message"].get("tool_calls")


def test_a_dropped_stream_is_logged_499(server, http):
    body = {"model": MODEL, "prompt": "drop me", "max_tokens": 200, "ignore_eos": True, "stream": True,
            "request_id": f"drop-{uuid.uuid4().hex[:8]}"}
    with http.stream("POST", "/v1/completions", json=body) as response:
        next(response.iter_lines())  # one event, then the client goes
    line = f"request cmpl-{body['request_id']} status="
    assert _poll(lambda: line in server.log())
    assert f"{line}499" in server.log(), [entry for entry in server.log().splitlines() if line in entry]


def test_a_completion_without_a_prompt_gets_vllms_sentence(http):
    # vLLM's clients send prompt_embeds=[] beside prompt=None; both mean "nothing given", not "embeddings refused"
    for body in ({"prompt": None, "prompt_embeds": [], "max_tokens": 1}, {"max_tokens": 1}):
        reply = http.post("/v1/completions", json=body)
        assert reply.status_code == 400 and error_param(reply) == "prompt", reply.text
        assert "Either prompt or prompt_embeds must be provided and non-empty" in reply.json()["error"]["message"]
    embeds = http.post("/v1/completions", json={"prompt_embeds": "AAAA", "max_tokens": 1})
    assert embeds.status_code == 400 and error_param(embeds) == "prompt_embeds", embeds.text


def test_prompt_messages(http):
    empty = http.post("/v1/completions", json={"prompt": [], "max_tokens": 1})
    assert error_param(empty) == "prompt" and "prompt or prompt_embeds" in empty.json()["error"]["message"]
    oov = http.post("/v1/completions", json={"prompt": [5, 999999], "max_tokens": 1})
    assert error_param(oov) == "prompt" and "999999 out of vocabulary" in oov.json()["error"]["message"]
