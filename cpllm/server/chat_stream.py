"""Chat choices, whole or as stream deltas, with tool calls where the ToolPlan finds them."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

from cpllm.engine.outputs import CompletionOutput
from cpllm.engine.sampling_params import SamplingParams
from cpllm.server import requests
from cpllm.server.formatting import ChoiceCursor, chat_logprobs, sse, usage
from cpllm.server.prompt_fields import echo_prefix, token_texts
from cpllm.server.protocol import ChatCompletionRequest
from cpllm.server.requests import ServerContext
from cpllm.server.tool_calls import ToolPlan, finish_reason, new_call_id, tool_call_dicts


def choice_message(ctx: ServerContext, req: ChatCompletionRequest, plan: ToolPlan, c: CompletionOutput,
                   num_top: int) -> dict:
    """One finished choice of a non-streamed response."""
    extracted = plan.extract(c.text)
    prefix = echo_prefix(req)
    content = prefix + (extracted.content or "") if prefix else extracted.content
    message: dict = {"role": "assistant", "content": content}
    if extracted.tool_calls:
        message["tool_calls"] = [{k: v for k, v in call.items() if k != "index"}
                                 for call in tool_call_dicts(extracted.tool_calls)]
    return {"index": c.index, "message": message,
            "logprobs": (chat_logprobs(token_texts(ctx.texts, req), c.token_ids, c.logprobs or [], num_top)
                         if req.logprobs else None),
            "finish_reason": finish_reason(extracted, c.finish_reason), "stop_reason": c.stop_reason}


@dataclasses.dataclass(slots=True)
class _ToolCursor(ChoiceCursor):
    """A streamed choice's progress, plus the id of the call it opened (named tool_choice)."""

    call_id: str | None = None


async def chat_events(ctx: ServerContext, req: ChatCompletionRequest, params: SamplingParams, plan: ToolPlan,
                      streams: list[requests.RequestStream], head: dict) -> AsyncIterator[str]:
    head = {**head, "object": "chat.completion.chunk"}
    include_usage = req.stream_options is not None and req.stream_options.include_usage
    extra = {"usage": None} if include_usage else {}
    cursors = [_ToolCursor() for _ in range(params.n)]
    prefix = echo_prefix(req)
    for index in range(params.n):  # OpenAI opens every choice with the role (and an echoed prefix, if any)
        yield sse({**head, "choices": [{"index": index, "delta": {"role": "assistant", "content": prefix},
                                        "logprobs": None, "finish_reason": None}], **extra})
    async for _, out in requests.merged(streams):
        for c in out.outputs:
            chunk = _delta_choice(ctx, req, params, plan, c, cursors[c.index])
            if chunk is not None:
                yield sse({**head, "choices": [chunk], **extra})
    if include_usage:
        yield sse({**head, "choices": [], "usage": usage([streams[0].last])})


def _delta_choice(ctx: ServerContext, req: ChatCompletionRequest, params: SamplingParams, plan: ToolPlan,
                  c: CompletionOutput, cursor: _ToolCursor) -> dict | None:
    if cursor.done:
        return None
    finished = c.finish_reason is not None
    delta, reason = _delta(plan, params, c, cursor, finished)
    if not delta and not finished:
        return None
    logprobs = None
    if req.logprobs:
        positions = (c.logprobs or [])[cursor.tokens : len(c.token_ids)]
        logprobs = chat_logprobs(token_texts(ctx.texts, req), c.token_ids[cursor.tokens :], positions,
                                 req.top_logprobs or 0)
    cursor.tokens = len(c.token_ids)
    cursor.done = finished
    return {"index": c.index, "delta": delta, "logprobs": logprobs, "finish_reason": reason,
            "stop_reason": c.stop_reason}


def _delta(plan: ToolPlan, params: SamplingParams, c: CompletionOutput, cursor: _ToolCursor,
           finished: bool) -> tuple[dict, str | None]:
    """What to send for this choice now, and its finish_reason (None while it runs)."""
    if plan.mode == "named":  # the text is the call's arguments: stream them as they grow
        text = cursor.advance(c.text, finished, params)
        delta = {}
        if cursor.call_id is None and (text or finished):
            cursor.call_id = new_call_id()
            delta = {"tool_calls": [{"index": 0, "id": cursor.call_id, "type": "function",
                                     "function": {"name": plan.function, "arguments": text}}]}
        elif text:
            delta = {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}
        reason = ("tool_calls" if c.finish_reason == "stop" else c.finish_reason) if finished else None
        return delta, reason
    if plan.mode == "none":
        text = cursor.advance(c.text, finished, params)
        return ({"content": text} if text else {}), c.finish_reason
    if not finished:  # auto: stream what surely is content; required: wait for the whole list
        if plan.mode == "required":
            return {}, None
        text = cursor.advance(c.text[: plan.parser.content_end(c.text)], False, params)
        return ({"content": text} if text else {}), None
    extracted = plan.extract(c.text)
    delta = {}
    if extracted.tool_calls:
        rest = (extracted.content or "")[cursor.chars :]
        if rest.strip():
            delta["content"] = rest
        delta["tool_calls"] = tool_call_dicts(extracted.tool_calls)
    else:
        rest = c.text[cursor.chars :]
        if rest:
            delta["content"] = rest
    cursor.chars = len(c.text)
    return delta, finish_reason(extracted, c.finish_reason)
