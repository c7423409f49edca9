"""vLLM's extra request fields, null handling, unknown-field warnings, OpenAI's validation rules and the tool-call
rules of "auto", against a real `cpllm serve` (the tiny random model, hermes parser) through the openai client.
The model's text is random, so tests assert on tokens and structure, not on words."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
from tiny_models import save_tiny_hf_model, tiny_hf_tokenizer

from cpllm.server.process import ServerProcess

FLAGS = ["--kv-cache-memory-bytes", "8MiB", "--max-model-len", "256", "--block-size", "4",
         "--served-model-name", "tiny", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
MODEL = "tiny"
ASK = [{"role": "user", "content": "hello"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
              "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
              "type": "object", "properties": {"tz": {"type": "string"}}}}}]  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = save_tiny_hf_model(str(tmp_path_factory.mktemp("tiny_fields")))
    with ServerProcess.running([folder, *FLAGS]) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=60, max_retries=0)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_hf_tokenizer()


def chat(client, **fields):
    return client.chat.completions.create(model=MODEL, **{"messages": ASK, "max_tokens": 4, **fields})


def error_of(response: httpx.Response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"], error
    return error


def post_chat(http, **fields) -> httpx.Response:
    return http.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 2, **fields})


# ---- chat template fields ------------------------------------------------------------------------------


def test_continue_final_message_leaves_the_assistant_turn_open(client, tokenizer):
    messages = [*ASK, {"role": "assistant", "content": "Hello, I am"}]
    reply = chat(client, messages=messages, extra_body={"continue_final_message": True, "echo": True,
                                                         "return_token_ids": True})
    prompt = tokenizer.decode(reply.model_extra["prompt_token_ids"])
    assert prompt.endswith("<|im_start|>assistant\nHello, I am"), prompt  # no end of turn, no new turn
    assert reply.choices[0].message.content.startswith("Hello, I am")  # echo puts the prefix back
    plain = chat(client, messages=messages, extra_body={"return_token_ids": True})
    assert tokenizer.decode(plain.model_extra["prompt_token_ids"]).endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_continue_final_message_rules(http):
    both = post_chat(http, messages=[*ASK, {"role": "assistant", "content": "Hi"}], continue_final_message=True,
                     add_generation_prompt=True)
    assert error_of(both)["param"] == "continue_final_message"
    assert error_of(post_chat(http, continue_final_message=True))["param"] == "continue_final_message"


def test_chat_template_and_its_kwargs(client, tokenizer):
    template = ("{% if enable_thinking is defined and not enable_thinking %}NOTHINK {% endif %}"
                "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    reply = chat(client, extra_body={"chat_template": template, "chat_template_kwargs": {"enable_thinking": False},
                                     "return_token_ids": True})
    assert tokenizer.decode(reply.model_extra["prompt_token_ids"]) == "NOTHINK hello"
    reply = chat(client, extra_body={"chat_template": template, "return_token_ids": True})
    assert tokenizer.decode(reply.model_extra["prompt_token_ids"]) == "hello"


# ---- prompt and token fields ---------------------------------------------------------------------------


def test_prompt_logprobs_and_token_ids(client):
    out = client.completions.create(model=MODEL, prompt="the cat sat", max_tokens=3, temperature=0, logprobs=1,
                                    extra_body={"prompt_logprobs": 2, "return_tokens_as_token_ids": True,
                                                "return_token_ids": True})
    choice = out.choices[0].model_extra
    assert len(choice["prompt_logprobs"]) == out.usage.prompt_tokens == len(choice["prompt_token_ids"])
    assert choice["prompt_logprobs"][0] is None
    for tok, position in zip(choice["prompt_token_ids"][1:], choice["prompt_logprobs"][1:]):
        assert str(tok) in position and len(position) <= 3  # the prompt's token plus up to 2 alternatives
    assert out.choices[0].logprobs.tokens == [f"token_id:{t}" for t in choice["token_ids"]]
    reply = chat(client, logprobs=True, extra_body={"prompt_logprobs": 0, "return_tokens_as_token_ids": True})
    assert len(reply.model_extra["prompt_logprobs"]) == reply.usage.prompt_tokens
    assert all(re.fullmatch(r"token_id:\d+", t.token) for t in reply.choices[0].logprobs.content)


def test_streamed_echo_carries_prompt_logprobs(client):
    chunks = list(client.completions.create(model=MODEL, prompt="the cat sat", max_tokens=3, temperature=0,
                                            echo=True, logprobs=1, stream=True))
    first = chunks[0].choices[0]
    assert first.text == "the cat sat"
    assert "".join(first.logprobs.tokens) == "the cat sat" and first.logprobs.token_logprobs[0] is None
    assert all(isinstance(lp, float) for lp in first.logprobs.token_logprobs[1:])


def test_truncate_prompt_tokens_and_add_special_tokens(client, tokenizer):
    out = client.completions.create(model=MODEL, prompt="the cat sat on the mat", max_tokens=2,
                                    extra_body={"truncate_prompt_tokens": 3, "return_token_ids": True})
    full = tokenizer.encode("the cat sat on the mat")
    assert out.choices[0].model_extra["prompt_token_ids"] == full[-3:]
    for add in (True, False):
        got = client.completions.create(model=MODEL, prompt="hello", max_tokens=1,
                                        extra_body={"add_special_tokens": add, "return_token_ids": True})
        assert got.choices[0].model_extra["prompt_token_ids"] == tokenizer.encode("hello", add_special_tokens=add)


def test_allowed_token_ids_restrict_every_token(client):
    allowed = {40, 50, 60, 70}
    out = client.completions.create(model=MODEL, prompt="hello", max_tokens=16, temperature=1.0, seed=3,
                                    extra_body={"allowed_token_ids": sorted(allowed), "ignore_eos": True,
                                                "return_token_ids": True})
    ids = out.choices[0].model_extra["token_ids"]
    assert len(ids) == 16 and set(ids) <= allowed


def test_skip_special_tokens(client):
    body = {"allowed_token_ids": [1], "ignore_eos": True}  # <|im_start|> only
    kept = client.completions.create(model=MODEL, prompt="hi", max_tokens=2,
                                     extra_body={**body, "skip_special_tokens": False})
    skipped = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body=body)
    assert kept.choices[0].text == "<|im_start|><|im_start|>" and skipped.choices[0].text == ""


def test_bad_words_never_appear(client, tokenizer):
    base = client.completions.create(model=MODEL, prompt="the world is", max_tokens=8, temperature=0,
                                     extra_body={"return_token_ids": True, "ignore_eos": True})
    ids = base.choices[0].model_extra["token_ids"]
    word = next(tokenizer.decode([t]) for t in ids if tokenizer.decode([t]).strip())
    banned = {t for t in ids if tokenizer.decode([t]).strip() == word.strip()}
    out = client.completions.create(model=MODEL, prompt="the world is", max_tokens=8, temperature=0,
                                    extra_body={"return_token_ids": True, "ignore_eos": True,
                                                "bad_words": [word.strip()]})
    assert not banned & set(out.choices[0].model_extra["token_ids"]), (word, banned)


def test_min_tokens_and_include_stop_str(client, tokenizer):
    eos = tokenizer.eos_token_id
    short = client.completions.create(model=MODEL, prompt="hi", max_tokens=8, temperature=0,
                                      logit_bias={str(eos): 100})
    assert short.usage.completion_tokens == 1
    held = client.completions.create(model=MODEL, prompt="hi", max_tokens=8, temperature=0,
                                     logit_bias={str(eos): 100}, extra_body={"min_tokens": 5})
    assert held.usage.completion_tokens >= 5
    text = client.completions.create(model=MODEL, prompt="the world is", max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = text.strip()[2:4]
    assert len(stop) == 2, text
    cut = client.completions.create(model=MODEL, prompt="the world is", max_tokens=12, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    kept = client.completions.create(model=MODEL, prompt="the world is", max_tokens=12, temperature=0, stop=[stop],
                                     extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert kept.choices[0].text == cut.choices[0].text + stop and stop not in cut.choices[0].text


# ---- refused, null and unknown fields ------------------------------------------------------------------


@pytest.mark.parametrize("path, field, value", [
    ("/v1/completions", "suffix", "tail"),
    ("/v1/completions", "use_beam_search", True),
    ("/v1/chat/completions", "prompt_embeds", "AAAA"),
    ("/v1/chat/completions", "priority", 3),
    ("/v1/chat/completions", "documents", [{"text": "x"}]),
    ("/v1/chat/completions", "logits_processors", ["x"]),
    ("/v1/chat/completions", "truncate_prompt_tokens", 0),
])  # fmt: skip
def test_refused_fields_are_400_naming_them(http, path, field, value):
    base = {"prompt": "hi"} if path == "/v1/completions" else {"messages": ASK}
    error = error_of(http.post(path, json={"model": MODEL, "max_tokens": 2, **base, field: value}))
    assert error["param"] == field and error["type"] == "invalid_request_error", error


def test_suffix_through_the_client(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, suffix="end")
    assert info.value.body["param"] == "suffix"


def test_explicit_nulls_mean_the_default(http):
    nulls = dict.fromkeys(["n", "stream", "logprobs", "top_logprobs", "echo", "parallel_tool_calls", "stop",
                           "temperature", "tool_choice", "stream_options", "seed", "add_generation_prompt",
                           "continue_final_message", "min_tokens", "skip_special_tokens", "response_format"])
    reply = post_chat(http, **nulls)
    assert reply.status_code == 200, reply.text
    assert len(reply.json()["choices"]) == 1 and reply.json()["choices"][0]["logprobs"] is None
    out = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": None, "echo": None,
                                            "n": None, "logprobs": None, "ignore_eos": True})
    assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 16  # max_tokens' default


def test_unknown_fields_are_ignored_with_one_warning(server, http):
    reply = post_chat(http, zz_unknown_one=1, zz_unknown_two={"a": 1})
    assert reply.status_code == 200, reply.text
    lines = [line for line in server.log().splitlines() if "zz_unknown_one" in line]
    assert len(lines) == 1 and "zz_unknown_two" in lines[0] and "WARNING" in lines[0].upper(), lines


# ---- validation ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("fields, param", [
    ({"messages": [{"role": "user"}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": None}]}, "messages.0.content"),
    ({"messages": [*ASK, {"role": "tool", "content": "21"}]}, "messages.1.tool_call_id"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"allowed_token_ids": [10**6]}, "allowed_token_ids"),
])  # fmt: skip
def test_openai_validation(http, fields, param):
    assert error_of(post_chat(http, **fields))["param"] == param


def test_image_part_is_refused_clearly(http):
    content = [{"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "http://x"}}]
    error = error_of(post_chat(http, messages=[{"role": "user", "content": content}]))
    assert error["param"] == "messages.0.content.1" and "image inputs are not supported" in error["message"]


def test_error_types_on_every_4xx(http):
    assert error_of(http.get("/v1/chat/completions"), 405)["type"] == "invalid_request_error"
    assert error_of(http.get("/v1/no-such-route"), 404)["type"] == "not_found_error"
    assert error_of(post_chat(http, model="other"), 404) == {**error_of(post_chat(http, model="other"), 404),
                                                             "type": "not_found_error", "param": "model"}


# ---- tool-call rules -----------------------------------------------------------------------------------


def _forced_text(*calls: dict) -> str:
    return "".join(f"<tool_call>{json.dumps(call)}</tool_call>" for call in calls)


WEATHER_CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
TIME_CALL = {"name": "get_time", "arguments": {"tz": "UTC"}}


def _auto(client, text: str, **fields):
    """A tool_choice="auto" reply whose text is forced (by a regex) to be `text`, so the parser sees real calls."""
    return chat(client, tools=TOOLS, max_tokens=200, temperature=0,
                extra_body={"guided_regex": re.escape(text)}, **fields)


def test_auto_parses_declared_calls(client):
    reply = _auto(client, _forced_text(WEATHER_CALL, TIME_CALL))
    calls = reply.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
    assert reply.choices[0].finish_reason == "tool_calls"


def test_parallel_tool_calls_false_keeps_the_first_call(client):
    text = _forced_text(WEATHER_CALL, TIME_CALL)
    reply = _auto(client, text, parallel_tool_calls=False)
    assert [c.function.name for c in reply.choices[0].message.tool_calls] == ["get_weather"]
    chunks = list(_auto(client, text, parallel_tool_calls=False, stream=True))
    streamed = [call for chunk in chunks for choice in chunk.choices for call in choice.delta.tool_calls or []]
    assert [c.function.name for c in streamed] == ["get_weather"]


def test_undeclared_function_is_content(client):
    text = _forced_text({"name": "launch_rocket", "arguments": {}})
    reply = _auto(client, text)
    assert not reply.choices[0].message.tool_calls and reply.choices[0].message.content == text
    assert reply.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("tool_choice", [None, "auto", "none", "required"])
def test_tool_schemas_are_validated_whatever_the_choice(http, tool_choice):
    tools = [TOOLS[0], {"type": "function", "function": {"name": "broken", "parameters": {
        "type": "object", "properties": {"x": {"type": "no-such-type"}}}}}]
    error = error_of(post_chat(http, tools=tools, **({"tool_choice": tool_choice} if tool_choice else {})))
    assert error["param"] == "tools.1.function.parameters", error
