"""POST /v1/chat/completions: messages through the model's chat template, streamed or not."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from cpllm.engine.outputs import CompletionOutput
from cpllm.engine.sampling_params import SamplingParams
from cpllm.server import requests
from cpllm.server.errors import bad_request
from cpllm.server.formatting import ChoiceCursor, chat_logprobs, sampling_params, sse, usage
from cpllm.server.protocol import ChatCompletionRequest
from cpllm.server.requests import Prompt, ServerContext


def chat_prompt(ctx: ServerContext, req: ChatCompletionRequest) -> Prompt:
    tokenizer = ctx.engine.tokenizer
    try:
        text = tokenizer.apply_chat_template(req.template_messages(), add_generation_prompt=req.add_generation_prompt)
    except Exception as exc:  # noqa: BLE001 - jinja raises many kinds; all mean "these messages do not fit"
        raise bad_request(f"the chat template failed on these messages: {exc}", "messages") from exc
    return Prompt(token_ids=tokenizer.encode(text, add_special_tokens=False), text=text)


async def create_chat_completion(ctx: ServerContext, req: ChatCompletionRequest, arrival_time: float):
    """A response dict, or an async iterator of server-sent events when req.stream."""
    prompt = chat_prompt(ctx, req)
    limit_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    num_top = req.top_logprobs or 0
    params = sampling_params(req, max_tokens=req.output_limit(), logprobs=num_top if req.logprobs else None,
                             max_tokens_param=limit_param)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    streams = await requests.start(ctx, request_id, [prompt], params, arrival_time, limit_param)
    head = {"id": request_id, "created": int(time.time()), "model": ctx.model_name}
    if req.stream:
        return requests.sse_events(head["id"], streams, _stream(ctx, req, params, streams, head))
    status = 500
    try:
        (output,) = await requests.results(streams)
        status = 200
    finally:
        requests.close(request_id, streams, status=status)
    choices = [
        {"index": c.index, "message": {"role": "assistant", "content": c.text},
         "logprobs": chat_logprobs(ctx.texts, c.token_ids, c.logprobs or [], num_top) if req.logprobs else None,
         "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        for c in output.outputs
    ]
    return {**head, "object": "chat.completion", "choices": choices, "usage": usage([output])}


async def _stream(ctx: ServerContext, req: ChatCompletionRequest, params: SamplingParams,
                  streams: list[requests.RequestStream], head: dict) -> AsyncIterator[str]:
    head = {**head, "object": "chat.completion.chunk"}
    include_usage = req.stream_options is not None and req.stream_options.include_usage
    extra = {"usage": None} if include_usage else {}
    cursors = [ChoiceCursor() for _ in range(params.n)]
    for index in range(params.n):  # OpenAI opens every choice with the role
        yield sse({**head, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}], **extra})
    async for _, out in requests.merged(streams):
        for c in out.outputs:
            chunk = _delta_choice(ctx, req, params, c, cursors[c.index])
            if chunk is not None:
                yield sse({**head, "choices": [chunk], **extra})
    if include_usage:
        yield sse({**head, "choices": [], "usage": usage([streams[0].last])})


def _delta_choice(ctx: ServerContext, req: ChatCompletionRequest, params: SamplingParams, c: CompletionOutput,
                  cursor: ChoiceCursor) -> dict | None:
    if cursor.done:
        return None
    finished = c.finish_reason is not None
    delta = cursor.advance(c.text, finished, params)
    if not delta and not finished:
        return None
    logprobs = None
    if req.logprobs:
        positions = (c.logprobs or [])[cursor.tokens : len(c.token_ids)]
        logprobs = chat_logprobs(ctx.texts, c.token_ids[cursor.tokens :], positions, req.top_logprobs or 0)
    cursor.tokens = len(c.token_ids)
    cursor.done = finished
    return {"index": c.index, "delta": {"content": delta} if delta else {}, "logprobs": logprobs,
            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
