"""A Responses API request turned into the chat completion request that serves it: instructions and input items
become chat messages, flat function tools become chat tools, text.format becomes response_format. Fields the
server knows but cannot honour are refused here with a 400 naming them."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

from cpllm.server.errors import bad_request, from_validation_error
from cpllm.server.protocol import ChatCompletionRequest
from cpllm.server.protocol_responses import (FunctionCallItem, FunctionCallOutputItem, MessageItem,
                                             ResponsesRequest, ResponsesTextFormat)
from cpllm.server.protocol_tools import FunctionDefinition

_ITEMS: dict[str, type[BaseModel]] = {"message": MessageItem, "function_call": FunctionCallItem,
                                      "function_call_output": FunctionCallOutputItem}

_NEEDS_STORAGE = ("previous_response_id", "conversation", "prompt")
"""Fields that refer to what an OpenAI server stored earlier; this one stores nothing."""


def refuse_unsupported(req: ResponsesRequest) -> None:
    """400 naming the first field that asks for something this server cannot do."""
    for name in _NEEDS_STORAGE:
        if getattr(req, name) is not None:
            raise bad_request(f"{name} is not supported: this server stores no responses, prompts or "
                              "conversations; send the whole conversation in `input`", name)
    refusals = {
        "background": (req.background, "background responses are not supported (nothing is stored to poll)"),
        "reasoning": (req.reasoning, "reasoning settings are not supported: the server has no reasoning parser"),
        "include": (req.include, f"include={req.include} is not supported: no extra output data is produced"),
        "top_logprobs": (req.top_logprobs, "top_logprobs is not supported on /v1/responses; use "
                                           "/v1/chat/completions for logprobs"),
        "max_tool_calls": (req.max_tool_calls, "max_tool_calls is not supported; parallel_tool_calls=false "
                                               "limits a forced call to one"),
        "truncation": (req.truncation == "auto", 'truncation "auto" is not supported: a prompt that does not '
                                                 'fit is refused, never cut (use "disabled")'),
    }
    for name, (value, message) in refusals.items():
        if value:
            raise bad_request(message, name)


def chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion request equivalent to `req` (which refuse_unsupported has passed)."""
    fields: dict[str, Any] = {
        "messages": chat_messages(req), "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature, "top_p": req.top_p, "seed": req.seed,
        "parallel_tool_calls": req.parallel_tool_calls if req.parallel_tool_calls is not None else True,
    }
    if req.tools:
        fields["tools"] = [{"type": "function", "function": _function(i, tool)} for i, tool in enumerate(req.tools)]
    if req.tool_choice is not None:
        fields["tool_choice"] = _tool_choice(req)
    fmt = req.text.format if req.text is not None else None
    forced = req.tools and (req.tool_choice == "required" or not isinstance(req.tool_choice, str | None))
    # text.format shapes the message text; a forced call has none (agent SDKs send both on every turn).
    if fmt is not None and fmt.type != "text" and not forced:
        fields["response_format"] = _response_format(fmt)
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:  # a shape that passed the Responses checks but not the chat ones
        raise from_validation_error(exc) from exc


def chat_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """instructions as a system message, then the input items in order; consecutive function calls become one
    assistant message with several tool_calls, as chat templates expect."""
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    items = [{"type": "message", "role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    if not items:
        raise bad_request("input is empty: give a string or at least one item", "input")
    for index, raw in enumerate(items):
        item = _item(index, raw)
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    return messages


def _item(index: int, raw: dict[str, Any]) -> BaseModel:
    kind = raw.get("type", "message" if "role" in raw else None)
    model = _ITEMS.get(kind)
    if model is None:
        raise bad_request(f"input.{index}.type: items of type {kind!r} are not supported; give message, "
                          "function_call or function_call_output items", f"input.{index}.type")
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        first = from_validation_error(exc)
        param = f"input.{index}.{first.param}" if first.param else f"input.{index}"
        raise bad_request(f"input.{index}.{first.message}" if first.param else first.message, param) from exc


def _function(index: int, tool: dict[str, Any]) -> dict[str, Any]:
    kind = tool.get("type", "function")
    if kind != "function":
        raise bad_request(f"tools.{index}.type: built-in tools such as {kind!r} are not supported; only "
                          '"function" tools are', f"tools.{index}.type")
    try:
        function = FunctionDefinition.model_validate({k: v for k, v in tool.items() if k != "type"})
    except ValidationError as exc:
        first = from_validation_error(exc)
        raise bad_request(f"tools.{index}.{first.message}", f"tools.{index}.{first.param}") from exc
    return function.model_dump(exclude_none=True)


def _tool_choice(req: ResponsesRequest) -> str | dict[str, Any]:
    choice = req.tool_choice
    if isinstance(choice, str):
        return choice
    if choice.type != "function" or not choice.name:
        raise bad_request(f"tool_choice of type {choice.type!r} is not supported; give none, auto, required or "
                          '{"type": "function", "name": ...}', "tool_choice")
    return {"type": "function", "function": {"name": choice.name}}


def _response_format(fmt: ResponsesTextFormat) -> dict[str, Any]:
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.json_schema is None:
        raise bad_request('text.format of type "json_schema" needs a schema', "text.format.schema")
    return {"type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.json_schema,
                                                   "strict": fmt.strict}}
