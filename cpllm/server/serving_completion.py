"""POST /v1/completions: prompts as text or token ids, streamed or not."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from cpllm.engine.outputs import CompletionOutput, RequestOutput
from cpllm.engine.sampling_params import SamplingParams
from cpllm.server import requests
from cpllm.server.errors import bad_request
from cpllm.server.formatting import ChoiceCursor, completion_logprobs, sampling_params, sse, usage
from cpllm.server.protocol import CompletionRequest
from cpllm.server.requests import Prompt, ServerContext
from cpllm.server.structured_fields import request_constraint


def _prompts(ctx: ServerContext, req: CompletionRequest) -> list[Prompt]:
    try:
        items = req.prompts()
    except ValueError as exc:
        raise bad_request(str(exc), "prompt") from exc
    tokenizer = ctx.engine.tokenizer
    return [Prompt(token_ids=tokenizer.encode(p), text=p) if isinstance(p, str)
            else Prompt(token_ids=list(p), text=None) for p in items]


async def create_completion(ctx: ServerContext, req: CompletionRequest, arrival_time: float):
    """A response dict, or an async iterator of server-sent events when req.stream."""
    constraint = request_constraint(req)
    prompts = _prompts(ctx, req)
    echo_logprobs = req.echo and req.logprobs is not None
    params = sampling_params(req, max_tokens=req.max_tokens, logprobs=req.logprobs,
                             prompt_logprobs=req.logprobs if echo_logprobs else None, max_n=ctx.options.max_n,
                             structured=constraint.params if constraint else None)
    await requests.compile_constraint(ctx, constraint)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    streams = await requests.start(ctx, request_id, prompts, params, arrival_time)
    head = {"id": request_id, "created": int(time.time()), "model": ctx.model_name}
    if req.stream:
        return requests.sse_events(head["id"], streams, _stream(ctx, req, params, prompts, streams, head))
    status = 500
    try:
        outputs = await requests.results(streams)
        status = 200
    finally:
        requests.close(request_id, streams, status=status)
    choices = [_choice(ctx, req, p, out, c, i * params.n + c.index)
               for i, (p, out) in enumerate(zip(prompts, outputs)) for c in out.outputs]
    return {**head, "object": "text_completion", "choices": choices, "usage": usage(outputs)}


def _prompt_text(ctx: ServerContext, prompt: Prompt) -> str:
    return prompt.text if prompt.text is not None else ctx.engine.tokenizer.decode(prompt.token_ids)


def _echo_logprobs(ctx: ServerContext, req: CompletionRequest, prompt: Prompt, out: RequestOutput) -> dict:
    positions = out.prompt_logprobs or [None] * len(prompt.token_ids)
    return completion_logprobs(ctx.texts, prompt.token_ids, positions, req.logprobs, 0)


def _choice(ctx: ServerContext, req: CompletionRequest, prompt: Prompt, out: RequestOutput, c: CompletionOutput,
            index: int) -> dict:
    prefix = _prompt_text(ctx, prompt) if req.echo else ""
    logprobs = None
    if req.logprobs is not None:
        logprobs = _echo_logprobs(ctx, req, prompt, out) if req.echo else None
        generated = completion_logprobs(ctx.texts, c.token_ids, c.logprobs or [], req.logprobs, len(prefix))
        logprobs = generated if logprobs is None else {k: logprobs[k] + generated[k] for k in generated}
    return {"index": index, "text": prefix + c.text, "logprobs": logprobs,
            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}


async def _stream(ctx: ServerContext, req: CompletionRequest, params: SamplingParams, prompts: list[Prompt],
                  streams: list[requests.RequestStream], head: dict) -> AsyncIterator[str]:
    head = {**head, "object": "text_completion"}
    n = params.n
    cursors = {}
    offsets = {}  # (prompt, choice) -> chars of echoed prompt text
    include_usage = req.stream_options is not None and req.stream_options.include_usage
    if req.echo:
        for i, prompt in enumerate(prompts):
            text = _prompt_text(ctx, prompt)
            for j in range(n):
                offsets[i, j] = len(text)
                yield sse({**head, "choices": [{"index": i * n + j, "text": text, "logprobs": None,
                                                "finish_reason": None, "stop_reason": None}],
                           **({"usage": None} if include_usage else {})})
    async for i, out in requests.merged(streams):
        for c in out.outputs:
            cursor = cursors.setdefault((i, c.index), ChoiceCursor())
            chunk = _delta_choice(ctx, req, params, c, cursor, offsets.get((i, c.index), 0), i * n + c.index)
            if chunk is not None:
                yield sse({**head, "choices": [chunk], **({"usage": None} if include_usage else {})})
    if include_usage:
        yield sse({**head, "choices": [], "usage": usage([s.last for s in streams])})


def _delta_choice(ctx: ServerContext, req: CompletionRequest, params: SamplingParams, c: CompletionOutput,
                  cursor: ChoiceCursor, echo_chars: int, index: int) -> dict | None:
    """The chunk for what choice `c` added since `cursor`, or None when there is nothing to send yet."""
    if cursor.done:
        return None
    finished = c.finish_reason is not None
    start_chars = cursor.chars
    delta = cursor.advance(c.text, finished, params)
    if not delta and not finished:
        return None  # held back (partial stop string): its tokens go with the next chunk
    logprobs = None
    if req.logprobs is not None:
        ids = c.token_ids[cursor.tokens :]
        positions = (c.logprobs or [])[cursor.tokens : len(c.token_ids)]
        logprobs = completion_logprobs(ctx.texts, ids, positions, req.logprobs, echo_chars + start_chars)
    cursor.tokens = len(c.token_ids)
    cursor.done = finished
    return {"index": index, "text": delta, "logprobs": logprobs, "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason}
