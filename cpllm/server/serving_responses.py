"""POST /v1/responses (OpenAI's Responses API), served by the chat pipeline: the request becomes a chat completion
request (responses_input.py), runs as one (serving_chat.start_chat: template, tools, constraint, engine), and its
choice is written back as Response output items, whole or as the API's stream of typed events."""

from __future__ import annotations

import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from cpllm.engine.outputs import RequestOutput
from cpllm.server import requests
from cpllm.server.formatting import ChoiceCursor
from cpllm.server.protocol_responses import ResponsesRequest
from cpllm.server.requests import ServerContext
from cpllm.server.responses_input import chat_request, refuse_unsupported
from cpllm.server.serving_chat import ChatRun, start_chat
from cpllm.server.tool_calls import new_call_id
from cpllm.server.tool_parsers import ParsedToolCall


async def create_response(ctx: ServerContext, req: ResponsesRequest, arrival_time: float):
    """A Response dict, or an async iterator of server-sent events when req.stream."""
    refuse_unsupported(req)
    chat = chat_request(req)
    response_id = f"resp_{uuid.uuid4().hex}"
    run = await start_chat(ctx, chat, response_id, arrival_time, "max_output_tokens")
    shell = _shell(ctx, req, run, response_id)
    if req.stream:
        return requests.sse_events(response_id, run.streams, _events(run, shell))
    (output,) = await requests.finished(response_id, run.streams)
    c = output.outputs[0]
    extracted = run.plan.extract(c.text)
    items = []
    if extracted.content:
        items.append(_message_item(extracted.content, _item_status(c.finish_reason)))
    items.extend(_call_item(call) for call in extracted.tool_calls)
    return _finished(shell, items, output)


def _shell(ctx: ServerContext, req: ResponsesRequest, run: ChatRun, response_id: str) -> dict[str, Any]:
    """The Response object's fields that do not depend on the output (the request's settings, echoed)."""
    fmt = req.text.format if req.text is not None and req.text.format is not None else None
    text_format = fmt.model_dump(by_alias=True, exclude_none=True) if fmt is not None else {"type": "text"}
    return {
        "id": response_id, "object": "response", "created_at": int(time.time()), "model": ctx.model_name,
        "status": "in_progress", "error": None, "incomplete_details": None, "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens, "metadata": req.metadata or {}, "output": [],
        "parallel_tool_calls": req.parallel_tool_calls is not False, "previous_response_id": None,
        "reasoning": None, "store": False, "background": False,
        "temperature": run.params.temperature, "top_p": run.params.top_p,
        "text": {"format": text_format}, "tool_choice": _echo_tool_choice(req),
        "tools": [{"type": "function", **{k: v for k, v in t.items() if k != "type"}} for t in req.tools or []],
        "truncation": "disabled", "usage": None, "user": req.user,
    }


def _echo_tool_choice(req: ResponsesRequest) -> Any:
    choice = req.tool_choice
    if choice is None:
        return "auto" if req.tools else "none"
    return choice if isinstance(choice, str) else {"type": "function", "name": choice.name}


def _finished(shell: dict[str, Any], items: list[dict[str, Any]], output: RequestOutput) -> dict[str, Any]:
    """The whole Response: "incomplete" (with the reason) when max_output_tokens cut it short."""
    reason = output.outputs[0].finish_reason
    cut = reason == "length"
    return {**shell, "status": "incomplete" if cut else "completed", "output": items,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None, "usage": _usage(output)}


def _usage(output: RequestOutput) -> dict[str, Any]:
    prompt, generated = len(output.prompt_token_ids), len(output.outputs[0].token_ids)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": output.num_cached_tokens},
            "output_tokens": generated,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt + generated}


def _item_status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def _message_item(text: str, status: str, item_id: str | None = None) -> dict[str, Any]:
    return {"id": item_id or f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "status": status,
            "content": [_text_part(text)]}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_item(call: ParsedToolCall, status: str = "completed") -> dict[str, Any]:
    return {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "call_id": new_call_id(), "name": call.name,
            "arguments": call.arguments, "status": status}


def _sse(payload: dict[str, Any]) -> str:
    data = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    return f"event: {payload['type']}\ndata: {data}\n\n"


class _Events:
    """Numbers the stream's events (sequence_number) and remembers the output items already sent."""

    def __init__(self) -> None:
        self._numbers = itertools.count()
        self.items: list[dict[str, Any]] = []

    def event(self, kind: str, **fields: Any) -> str:
        return _sse({"type": kind, "sequence_number": next(self._numbers), **fields})


async def _events(run: ChatRun, shell: dict[str, Any]) -> AsyncIterator[str]:
    """created, in_progress; the message's text as it is generated (while it surely is content); at the end the
    rest of the text and any function calls, each item closed by its done events; then completed/incomplete."""
    out = _Events()
    yield out.event("response.created", response=shell)
    yield out.event("response.in_progress", response=shell)
    cursor, message_id, last = ChoiceCursor(), None, None
    async for _, last in requests.merged(run.streams):
        c = last.outputs[0]
        delta = _streamable(run, c.text, cursor) if c.finish_reason is None else ""
        if delta:
            if message_id is None:
                message_id = f"msg_{uuid.uuid4().hex}"
                for event in _open_message(out, message_id):
                    yield event
            yield out.event("response.output_text.delta", item_id=message_id, output_index=0, content_index=0,
                            delta=delta, logprobs=[])
    c = last.outputs[0]
    extracted = run.plan.extract(c.text)
    content = extracted.content or ""
    rest = content[cursor.chars :]
    if message_id is None and content:
        message_id = f"msg_{uuid.uuid4().hex}"
        for event in _open_message(out, message_id):
            yield event
    if message_id is not None:
        if rest:
            yield out.event("response.output_text.delta", item_id=message_id, output_index=0, content_index=0,
                            delta=rest, logprobs=[])
        for event in _close_message(out, message_id, content, _item_status(c.finish_reason)):
            yield event
    for call in extracted.tool_calls:
        for event in _call_events(out, call):
            yield event
    final = _finished(shell, out.items, last)
    kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
    yield out.event(kind, response=final)


def _streamable(run: ChatRun, text: str, cursor: ChoiceCursor) -> str:
    """New text that is surely content while the choice runs: all of it without tools, the part before a call
    could start under "auto", nothing when the output is a forced call."""
    if run.plan.mode == "none":
        return cursor.advance(text, False, run.params)
    if run.plan.mode == "auto":
        return cursor.advance(text[: run.plan.parser.content_end(text)], False, run.params)
    return ""


def _open_message(out: _Events, message_id: str) -> list[str]:
    index = len(out.items)
    out.items.append(_message_item("", "in_progress", message_id))
    item = {**out.items[index], "content": []}
    return [out.event("response.output_item.added", output_index=index, item=item),
            out.event("response.content_part.added", item_id=message_id, output_index=index, content_index=0,
                      part=_text_part(""))]


def _close_message(out: _Events, message_id: str, text: str, status: str) -> list[str]:
    index = next(i for i, item in enumerate(out.items) if item["id"] == message_id)
    out.items[index] = _message_item(text, status, message_id)
    return [out.event("response.output_text.done", item_id=message_id, output_index=index, content_index=0,
                      text=text, logprobs=[]),
            out.event("response.content_part.done", item_id=message_id, output_index=index, content_index=0,
                      part=_text_part(text)),
            out.event("response.output_item.done", output_index=index, item=out.items[index])]


def _call_events(out: _Events, call: ParsedToolCall) -> list[str]:
    index = len(out.items)
    item = _call_item(call)
    out.items.append(item)
    opened = {**item, "arguments": "", "status": "in_progress"}
    return [out.event("response.output_item.added", output_index=index, item=opened),
            out.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                      delta=item["arguments"]),
            out.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                      name=item["name"], arguments=item["arguments"]),
            out.event("response.output_item.done", output_index=index, item=item)]
