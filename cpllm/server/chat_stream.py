"""Chat choices, whole or as stream deltas, with tool calls where the ToolPlan finds them and the thinking split off
where the request has a Reasoning (--reasoning-parser)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

from cpllm.engine.outputs import CompletionOutput
from cpllm.engine.sampling_params import SamplingParams
from cpllm.server import requests
from cpllm.server.chat_run import ChatRun
from cpllm.server.formatting import ChoiceCursor, chat_logprobs, sse
from cpllm.server.prompt_fields import echo_prefix, token_texts
from cpllm.server.protocol import ChatCompletionRequest
from cpllm.server.requests import ServerContext
from cpllm.server.request_metrics import metrics_field
from cpllm.server.stream_usage import StreamUsage
from cpllm.server.reasoning import Reasoning, output_parts
from cpllm.server.tool_calls import ToolPlan, finish_reason, new_call_id, tool_call_dicts


def choice_message(ctx: ServerContext, req: ChatCompletionRequest, plan: ToolPlan, c: CompletionOutput,
                   num_top: int, reasoning: Reasoning | None = None) -> dict:
    """One finished choice of a non-streamed response (`reasoning` and `reasoning_content` are null unless a
    reasoning parser split some thinking off)."""
    thought, text = output_parts(reasoning, c.text, True) if reasoning is not None else (None, c.text)
    extracted = plan.extract(text or "")
    prefix = echo_prefix(req)
    content = prefix + (extracted.content or "") if prefix else extracted.content
    if text is None and not prefix:
        content = None  # still thinking when the output ended
    message: dict = {"role": "assistant", "content": content, "reasoning": thought, "reasoning_content": thought}
    if extracted.tool_calls:
        message["tool_calls"] = [{k: v for k, v in call.items() if k != "index"}
                                 for call in tool_call_dicts(extracted.tool_calls)]
    return {"index": c.index, "message": message,
            "logprobs": (chat_logprobs(token_texts(ctx.texts, req), c.token_ids, c.logprobs or [], num_top,
                                       req.logprob_token_ids) if req.logprobs else None),
            "finish_reason": finish_reason(extracted, c.finish_reason), "stop_reason": c.stop_reason}


@dataclasses.dataclass(slots=True)
class _ToolCursor(ChoiceCursor):
    """A streamed choice's progress, plus the id of the call it opened (named tool_choice)."""

    call_id: str | None = None
    reasoning_chars: int = 0
    """Characters of the reasoning sent so far."""


async def chat_events(ctx: ServerContext, run: ChatRun, head: dict) -> AsyncIterator[str]:
    """The stream's chunks. With return_token_ids the first chunk carries the prompt's ids (`prompt_token_ids`,
    on that chunk only, as vLLM) and every choice chunk its new tokens' ids (`token_ids`)."""
    req, params, plan, streams, prompt_token_ids = run.request, run.params, run.plan, run.streams, run.prompt.token_ids
    head = {**head, "object": "chat.completion.chunk"}
    reporting = StreamUsage.of(req, ctx.options, len(prompt_token_ids))
    ids = {"token_ids": []} if req.return_token_ids else {}
    cursors = [_ToolCursor() for _ in range(params.n)]
    prefix = echo_prefix(req)
    for index in range(params.n):  # OpenAI opens every choice with the role (and an echoed prefix, if any)
        first = index == 0 and req.return_token_ids
        yield sse({**head, "choices": [{"index": index, "delta": {"role": "assistant", "content": prefix},
                                        "logprobs": None, "finish_reason": None, **ids}],
                   **({"prompt_token_ids": list(prompt_token_ids)} if first else {}),
                   **reporting.chunk_fields(streams)})
    async for _, out in requests.merged(streams):
        for c in out.outputs:
            sent_tokens = cursors[c.index].tokens
            chunk = _delta_choice(ctx, req, params, plan, c, cursors[c.index], run.reasoning)
            if chunk is not None:
                if req.return_token_ids:
                    chunk["token_ids"] = list(c.token_ids[sent_tokens : cursors[c.index].tokens])
                yield sse({**head, "choices": [chunk], **reporting.chunk_fields(streams)})
    if reporting.final:  # per-request metrics ride on this chunk only, as in vLLM
        yield sse({**head, "choices": [], "usage": reporting.now(streams),
                   **metrics_field(ctx.options.enable_per_request_metrics, params.n, streams[0].last)})


def _delta_choice(ctx: ServerContext, req: ChatCompletionRequest, params: SamplingParams, plan: ToolPlan,
                  c: CompletionOutput, cursor: _ToolCursor, reasoning: Reasoning | None) -> dict | None:
    if cursor.done:
        return None
    finished = c.finish_reason is not None
    thought = ""
    if reasoning is not None:  # the thinking streams as `reasoning`; the content part goes on as without a parser
        so_far, text = output_parts(reasoning, c.text, finished)
        thought = (so_far or "")[cursor.reasoning_chars :]
        cursor.reasoning_chars += len(thought)
        c = dataclasses.replace(c, text=text or "")
    delta, reason = _delta(plan, params, c, cursor, finished)
    if thought:
        delta = {"reasoning": thought, "reasoning_content": thought, **delta}
    if not delta and not finished:
        return None
    logprobs = None
    if req.logprobs:
        positions = (c.logprobs or [])[cursor.tokens : len(c.token_ids)]
        logprobs = chat_logprobs(token_texts(ctx.texts, req), c.token_ids[cursor.tokens :], positions,
                                 req.top_logprobs or 0, req.logprob_token_ids)
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
