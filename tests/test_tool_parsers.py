"""Tool-call parsers on recorded model texts, and what tool_choice resolves to (no model needed)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from cpllm.server.errors import APIError
from cpllm.server.options import ServeOptions
from cpllm.server.protocol import ChatCompletionRequest
from cpllm.server.tool_calls import finish_reason, plan_tools
from cpllm.server.tool_parsers import HermesToolParser, Llama3JsonToolParser, get_parser

# What Qwen2.5-7B-Instruct wrote for "weather in Paris and in Tokyo?" with two tools (hermes format).
HERMES_TWO_CALLS = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tokyo", "unit": "celsius"}}\n</tool_call>'
)
HERMES_WITH_PREAMBLE = ('Let me look that up.\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n'
                        "</tool_call>")
# Llama-3.1-8B-Instruct's JSON tool call (its template asks for {"name", "parameters"}).
LLAMA3_CALL = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}'
LLAMA3_TWO = '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": 1}}'

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "now"}}]


def test_hermes_calls_and_content():
    out = HermesToolParser().extract(HERMES_TWO_CALLS)
    assert out.content is None
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_weather", {"city": "Tokyo", "unit": "celsius"})]
    pre = HermesToolParser().extract(HERMES_WITH_PREAMBLE)
    assert pre.content == "Let me look that up.\n" and pre.tool_calls[0].name == "get_time"
    unclosed = HermesToolParser().extract('<tool_call>{"name": "f", "arguments": {"a": 1}}')
    assert unclosed.tool_calls[0].arguments == '{"a": 1}'  # the model stopped before </tool_call>
    stringified = HermesToolParser().extract('<tool_call>{"name": "f", "arguments": "{\\"a\\": 2}"}</tool_call>')
    assert json.loads(stringified.tool_calls[0].arguments) == {"a": 2}


@pytest.mark.parametrize("text", ["no calls here", '<tool_call>{"name": "f", "arguments": {oops}}</tool_call>',
                                  '<tool_call>{"arguments": {}}</tool_call>'])
def test_hermes_without_valid_calls_returns_the_text(text):
    out = HermesToolParser().extract(text)
    assert out.content == text and out.tool_calls == []


def test_hermes_streaming_holds_back_a_possible_tag():
    parser = HermesToolParser()
    assert parser.content_end("Sure") == 4
    assert parser.content_end("Sure <tool_") == 5  # may become <tool_call>
    assert parser.content_end("Sure <tool_call>{") == 5
    assert parser.content_end("a < b") == 5


def test_llama3_json_calls():
    out = Llama3JsonToolParser().extract(LLAMA3_CALL)
    assert out.content is None and out.tool_calls[0].name == "get_weather"
    assert json.loads(out.tool_calls[0].arguments) == {"city": "Paris", "unit": "celsius"}
    two = Llama3JsonToolParser().extract(LLAMA3_TWO)
    assert [(c.name, json.loads(c.arguments)) for c in two.tool_calls] == [("a", {}), ("b", {"x": 1})]
    for text in ("The weather is fine.", '{"city": "Paris"}', '{"name": "f", "parameters": {"a": 1}} trailing'):
        plain = Llama3JsonToolParser().extract(text)
        assert plain.content == text and plain.tool_calls == []


def test_llama3_streaming_waits_only_for_calls():
    parser = Llama3JsonToolParser()
    assert parser.content_end("  ") == 0
    assert parser.content_end("Hello") == 5
    assert parser.content_end(' {"name"') == 0
    assert parser.content_end("<|py") == 0
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        get_parser("mistral")


def _request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})


def test_tool_choice_resolution():
    auto = ServeOptions(enable_auto_tool_choice=True, tool_call_parser="hermes")
    assert plan_tools(_request(), ServeOptions()).mode == "none"
    assert plan_tools(_request(tools=TOOLS), ServeOptions()).mode == "none"  # no parser: tools only for the template
    assert plan_tools(_request(tools=TOOLS), auto).mode == "auto"
    assert plan_tools(_request(tools=TOOLS, tool_choice="none"), auto).template_tools[0]["function"]["name"] \
        == "get_weather"
    with pytest.raises(APIError, match="--enable-auto-tool-choice"):
        plan_tools(_request(tools=TOOLS, tool_choice="auto"), ServeOptions())
    with pytest.raises(APIError, match="not among the tools"):
        plan_tools(_request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), auto)
    with pytest.raises(APIError, match="needs tools"):
        plan_tools(_request(tool_choice="required"), auto)
    named = plan_tools(_request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}}), auto)
    assert named.mode == "named" and named.constraint.json["type"] == "object"  # no parameters: an empty object


def test_required_schema_accepts_exactly_calls_of_the_tools():
    plan = plan_tools(_request(tools=TOOLS, tool_choice="required", parallel_tool_calls=False), ServeOptions())
    schema = plan.constraint.json
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Oslo"}}], schema)
    for bad in ([], [{"name": "other", "parameters": {}}], [{"name": "get_weather", "parameters": {}}],
                [{"name": "get_time", "parameters": {}}] * 2):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    out = plan.extract('[{"name": "get_weather", "parameters": {"city": "Oslo"}}]')
    assert out.tool_calls[0].name == "get_weather" and json.loads(out.tool_calls[0].arguments) == {"city": "Oslo"}
    assert finish_reason(out, "stop") == "tool_calls" and finish_reason(out, "length") == "length"
    cut = plan.extract('[{"name": "get_weather", "param')
    assert cut.tool_calls == [] and finish_reason(cut, "length") == "length"


def _stream_deltas(plan, texts: list[str], finish: str = "stop") -> list[tuple[dict, str | None]]:
    """The deltas a stream sends as a choice's text grows through `texts` (the last one finished)."""
    from cpllm.engine.outputs import CompletionOutput
    from cpllm.engine.sampling_params import SamplingParams
    from cpllm.server.chat_stream import _delta, _ToolCursor

    cursor, params, out = _ToolCursor(), SamplingParams(), []
    for i, text in enumerate(texts):
        last = i == len(texts) - 1
        c = CompletionOutput(index=0, text=text, token_ids=[], finish_reason=finish if last else None)
        delta, reason = _delta(plan, params, c, cursor, last)
        if delta or last:
            out.append((delta, reason))
    return out


def test_auto_stream_sends_content_then_whole_calls():
    plan = plan_tools(_request(tools=TOOLS), ServeOptions(enable_auto_tool_choice=True, tool_call_parser="hermes"))
    steps = [HERMES_WITH_PREAMBLE[:k] for k in (5, 12, 22, 30, 60)] + [HERMES_WITH_PREAMBLE]
    deltas = _stream_deltas(plan, steps)
    content = "".join(d.get("content", "") for d, _ in deltas)
    assert content == "Let me look that up.\n"  # the call's text never leaks into content
    calls = [c for d, _ in deltas for c in d.get("tool_calls", [])]
    assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        (0, "get_time", {"tz": "UTC"})]
    assert deltas[-1][1] == "tool_calls"
    plain = _stream_deltas(plan, ["Hel", "Hello <to", "Hello <tool? no"])
    assert "".join(d.get("content", "") for d, _ in plain) == "Hello <tool? no" and plain[-1][1] == "stop"


def test_named_stream_sends_arguments_as_they_grow():
    plan = plan_tools(_request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}),
                      ServeOptions())
    deltas = _stream_deltas(plan, ['{"ci', '{"city": "Pa', '{"city": "Paris"}'])
    first = deltas[0][0]["tool_calls"][0]
    assert first["id"].startswith("call_") and first["function"]["name"] == "get_weather"
    arguments = "".join(d["tool_calls"][0]["function"]["arguments"] for d, _ in deltas if d)
    assert json.loads(arguments) == {"city": "Paris"} and deltas[-1][1] == "tool_calls"
