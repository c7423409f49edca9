"""`cpllm serve`'s endpoints beside the generation ones, driven by the official openai client and httpx on the tiny
random model: /tokenize, /detokenize, /version, /ping, /v1/models/{id} and the Responses API (/v1/responses).

A tiny random model says nothing sensible, so tool calls are forced by tool_choice and structured output by
text.format: the grammar, not the model, makes the output a valid call or a schema-valid object."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import openai
import pydantic
import pytest
from tiny_models import save_tiny_hf_model
from transformers import AutoTokenizer

from cpllm.server.process import ServerProcess

ENGINE_FLAGS = ["--kv-cache-memory-bytes", "4MiB", "--max-model-len", "256", "--block-size", "4"]
WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
                "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                               "required": ["city"]}}
VERDICT_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "grade": {"enum": ["a", "b"]}},
                  "required": ["ok", "grade"]}


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> str:
    return save_tiny_hf_model(str(tmp_path_factory.mktemp("tiny_endpoints")))


@pytest.fixture(scope="module")
def server(model_folder):
    with ServerProcess.running([model_folder, *ENGINE_FLAGS]) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=60, max_retries=0)


@pytest.fixture(scope="module")
def hf_tokenizer(model_folder):
    return AutoTokenizer.from_pretrained(model_folder, local_files_only=True)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def error_param(response: httpx.Response) -> str | None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    return error["param"]


# ---- tokenize, detokenize, version, ping, models ---------------------------------------------------------


def test_tokenize_detokenize_round_trip(server, hf_tokenizer, model_folder):
    text = "hello world, the cat sat on the mat"
    got = post(server, "/tokenize", {"model": model_folder, "prompt": text, "return_token_strs": True}).json()
    assert got["tokens"] == hf_tokenizer.encode(text, add_special_tokens=True)
    assert got["count"] == len(got["tokens"]) and got["max_model_len"] == 256
    assert got["token_strs"] == hf_tokenizer.convert_ids_to_tokens(got["tokens"])
    plain = post(server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert plain["tokens"] == hf_tokenizer.encode(text, add_special_tokens=False) and plain["token_strs"] is None
    back = post(server, "/detokenize", {"model": model_folder, "tokens": plain["tokens"]}).json()
    assert back == {"prompt": text}


def test_tokenize_chat_form_renders_the_chat_template(server, hf_tokenizer):
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "the cat"}]
    opened = post(server, "/tokenize", {"messages": messages[:1]}).json()
    expected = hf_tokenizer.apply_chat_template(messages[:1], add_generation_prompt=True, tokenize=False)
    assert opened["tokens"] == hf_tokenizer.encode(expected, add_special_tokens=False)
    continued = post(server, "/tokenize", {"messages": messages, "continue_final_message": True}).json()
    assert hf_tokenizer.decode(continued["tokens"]).endswith("assistant\nthe cat")


def test_tokenize_and_detokenize_refuse_bad_input(server, hf_tokenizer):
    vocab = len(hf_tokenizer)
    response = post(server, "/detokenize", {"tokens": [1, vocab + 5]})
    assert error_param(response) == "tokens.1"
    message = response.json()["error"]["message"]
    assert str(vocab + 5) in message and str(vocab - 1) in message
    assert error_param(post(server, "/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}))
    assert post(server, "/tokenize", {"model": "other", "prompt": "a"}).status_code == 404


def test_version_ping_and_model_retrieve(server, client, model_folder):
    assert httpx.get(f"{server.url}/version", timeout=10).json()["version"]
    assert httpx.get(f"{server.url}/ping", timeout=10).status_code == 200
    assert httpx.post(f"{server.url}/ping", timeout=10).status_code == 200
    card = client.models.retrieve(model_folder)
    assert card.id == model_folder and card.object == "model"
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("no-such-model")
    assert caught.value.body["code"] == "model_not_found"


# ---- the Responses API -------------------------------------------------------------------------------------


def test_responses_create_plain_and_with_instructions(client, model_folder):
    plain = client.responses.create(model=model_folder, input="hello world", max_output_tokens=6, temperature=0)
    assert plain.object == "response" and plain.status in ("completed", "incomplete")
    assert plain.output[0].type == "message" and plain.output_text
    assert plain.usage.output_tokens <= 6
    assert plain.usage.total_tokens == plain.usage.input_tokens + plain.usage.output_tokens
    told = client.responses.create(model=model_folder, input="hello world", instructions="Answer in French.",
                                   max_output_tokens=6, temperature=0)
    assert told.instructions == "Answer in French." and told.usage.input_tokens > plain.usage.input_tokens


def test_responses_input_items_match_the_chat_pipeline(client, model_folder):
    """Multi-turn items (a call and its output) give the same prompt and greedy text as the chat messages."""
    items = [{"role": "user", "content": [{"type": "input_text", "text": "weather in Paris?"}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": '{"temperature": 21}'},
             {"type": "message", "role": "user", "content": "and so?"}]
    reply = client.responses.create(model=model_folder, input=items, tools=[WEATHER_TOOL], tool_choice="none",
                                    max_output_tokens=8, temperature=0)
    messages = [{"role": "user", "content": "weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
                {"role": "user", "content": "and so?"}]
    chat = client.chat.completions.create(model=model_folder, messages=messages, max_tokens=8, temperature=0,
                                          tools=[{"type": "function", "function": {
                                              k: v for k, v in WEATHER_TOOL.items() if k != "type"}}],
                                          tool_choice="none")
    assert reply.output_text == chat.choices[0].message.content
    assert reply.usage.input_tokens == chat.usage.prompt_tokens


def test_responses_forced_tool_call(client, model_folder):
    reply = client.responses.create(model=model_folder, input="weather in Rome?", tools=[WEATHER_TOOL],
                                    tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=40,
                                    temperature=0)
    (call,) = [item for item in reply.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    assert json.loads(call.arguments)["city"] in ("Paris", "Rome")
    required = client.responses.create(model=model_folder, input="weather?", tools=[WEATHER_TOOL],
                                       tool_choice="required", parallel_tool_calls=False, max_output_tokens=60,
                                       temperature=0)
    assert [item.name for item in required.output if item.type == "function_call"] == ["get_weather"]


def test_responses_json_schema_output_validates(client, model_folder):
    reply = client.responses.create(
        model=model_folder, input="grade this", max_output_tokens=200, temperature=0,
        text={"format": {"type": "json_schema", "name": "verdict", "schema": VERDICT_SCHEMA, "strict": True}})
    assert reply.status == "completed", reply.output_text
    parsed = json.loads(reply.output_text)
    assert isinstance(parsed["ok"], bool) and parsed["grade"] in ("a", "b") and set(parsed) == {"ok", "grade"}
    assert reply.text.format.type == "json_schema"

    class Verdict(pydantic.BaseModel):
        ok: bool
        grade: Literal["a", "b"]

    typed = client.responses.parse(model=model_folder, input="grade this", max_output_tokens=200, temperature=0,
                                   text_format=Verdict)
    assert typed.output_parsed == Verdict.model_validate(parsed)
    anything = client.responses.create(model=model_folder, input="grade this", max_output_tokens=60, temperature=0,
                                       text={"format": {"type": "json_object"}})
    assert anything.status == "incomplete" or isinstance(json.loads(anything.output_text), dict)


def test_responses_stream_matches_create(client, model_folder):
    kwargs = dict(model=model_folder, input="the cat sat on the mat", max_output_tokens=10, temperature=0)
    whole = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] == ("response.completed" if whole.status == "completed" else "response.incomplete")
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


def test_responses_stream_forced_tool_call(client, model_folder):
    with client.responses.stream(model=model_folder, input="weather?", tools=[WEATHER_TOOL], max_output_tokens=40,
                                 temperature=0, tool_choice={"type": "function", "name": "get_weather"}) as stream:
        events = list(stream)
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [item.type for item in done] == ["function_call"]
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert arguments == done[0].arguments and json.loads(arguments)["city"] in ("Paris", "Rome")


@pytest.mark.parametrize("extra, param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"background": True}, "background"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"reasoning": {"effort": "low"}}, "reasoning"),
    ({"truncation": "auto"}, "truncation"),
    ({"input": [{"type": "input_image", "image_url": "http://x"}]}, "input.0.type"),
    ({"input": [{"role": "user"}]}, "input.0.content"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"max_output_tokens": 10_000}, "max_output_tokens"),
])
def test_responses_refuses_what_it_cannot_honour(server, extra, param):
    assert error_param(post(server, "/v1/responses", {"input": "hello", "max_output_tokens": 4, **extra})) == param


def test_openai_agents_sdk_runs_a_tool_turn(server, model_folder):
    """The OpenAI Agents SDK on /v1/responses: a forced call, the SDK runs the tool and sends its output back as a
    function_call_output item, and the next turn (tool_choice reset) answers in text."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    calls = []

    class Verdict(pydantic.BaseModel):
        ok: bool
        grade: Literal["a", "b"]

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return "sunny"

    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=60, max_retries=0)
    agent = agents.Agent(name="weather", instructions="Be brief.", tools=[get_weather], output_type=Verdict,
                         model=agents.OpenAIResponsesModel(model=model_folder, openai_client=client),
                         model_settings=agents.ModelSettings(tool_choice="get_weather", temperature=0,
                                                             max_tokens=140))
    result = agents.Runner.run_sync(agent, "Paris?", max_turns=3)
    assert len(calls) == 1 and calls[0] in ("Paris", "Rome")
    assert isinstance(result.final_output, Verdict)


def test_nulls_mean_defaults_and_unknown_fields_are_ignored(server):
    body = {"input": "hello", "max_output_tokens": 4, "temperature": None, "tools": None, "stream": None,
            "instructions": None, "service_tier": "auto", "zz_new_field": 1}
    response = post(server, "/v1/responses", body)
    assert response.status_code == 200 and response.json()["status"] in ("completed", "incomplete")
    assert post(server, "/tokenize", {"prompt": "hello", "add_special_tokens": None, "zz": 1}).json()["count"] > 0
