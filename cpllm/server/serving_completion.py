"""POST /v1/completions: prompts as text or token ids, streamed or not."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

from cpllm.engine.outputs import CompletionOutput, RequestOutput
from cpllm.engine.sampling_params import SamplingParams
from cpllm.server import requests
from cpllm.server.beam_search import beam_search, beam_settings, check_beam_request
from cpllm.server.errors import bad_request
from cpllm.server.formatting import ChoiceCursor, completion_logprobs, kv_transfer_answer, sampling_params, sse, usage
from cpllm.server.prompt_fields import (bad_words_token_ids, check_allowed_token_ids, check_token_ids,
                                        prompt_logprobs_json, resolved_counts, token_texts, truncated)
from cpllm.server.protocol import CompletionRequest
from cpllm.server.requests import Prompt, ServerContext
from cpllm.server.request_metrics import metrics_field
from cpllm.server.stream_usage import StreamUsage
from cpllm.server.structured_fields import request_constraint


def _prompts(ctx: ServerContext, req: CompletionRequest) -> list[Prompt]:
    try:
        items = req.prompts()
    except ValueError as exc:
        raise bad_request(str(exc), "prompt") from exc
    tokenizer = ctx.engine.tokenizer
    for item in items:
        if not isinstance(item, str):
            check_token_ids(item, tokenizer.vocab_size, "prompt")
    prompts = [Prompt(token_ids=tokenizer.encode(p, add_special_tokens=req.add_special_tokens), text=p)
               if isinstance(p, str) else Prompt(token_ids=list(p), text=None) for p in items]
    if req.truncate_prompt_tokens is None:
        return prompts
    out = []
    for prompt in prompts:
        kept = truncated(prompt.token_ids, req, ctx.engine.max_model_len)
        out.append(prompt if len(kept) == len(prompt.token_ids) else Prompt(token_ids=kept, text=None))
    return out


async def create_completion(ctx: ServerContext, req: CompletionRequest, arrival_time: float):
    """A response dict, or an async iterator of server-sent events when req.stream."""
    req, limit = resolved_counts(ctx, req, ("logprobs", "prompt_logprobs"), wants_logprobs=req.logprobs is not None)
    constraint = request_constraint(req)
    prompts = _prompts(ctx, req)
    if req.kv_transfer_params and len(prompts) > 1:  # the answer carries one prompt's blocks
        raise bad_request("kv_transfer_params with several prompts: send one prompt per request", "prompt")
    check_allowed_token_ids(req, ctx.engine.tokenizer.vocab_size)
    asked = [n for n in (req.prompt_logprobs, req.logprobs if req.echo else None) if n is not None]
    params = sampling_params(req, max_tokens=req.max_tokens, logprobs=req.logprobs,
                             prompt_logprobs=max(asked) if asked else None, max_n=ctx.options.max_n,
                             structured=constraint.params if constraint else None,
                             bad_words_token_ids=bad_words_token_ids(ctx.engine.tokenizer, req.bad_words),
                             max_logprobs=limit)
    request_id = f"cmpl-{req.request_id or uuid.uuid4().hex}"
    if req.use_beam_search:
        return await _beam_completion(ctx, req, prompts, params, request_id, arrival_time)
    await requests.compile_constraint(ctx, constraint)
    streams = await requests.start(ctx, request_id, prompts, params, arrival_time)
    head = {"id": request_id, "created": int(time.time()), "model": ctx.model_name}
    if req.stream:
        return requests.sse_events(head["id"], streams, _stream(ctx, req, params, prompts, streams, head))
    outputs = await requests.finished(request_id, streams)
    choices = [_choice(ctx, req, p, out, c, i * params.n + c.index)
               for i, (p, out) in enumerate(zip(prompts, outputs)) for c in out.outputs]
    return {**head, "object": "text_completion", "choices": choices,
            "usage": usage(outputs, ctx.options.enable_prompt_tokens_details), **kv_transfer_answer(outputs),
            **_metrics(ctx, params, outputs)}


async def _beam_completion(ctx: ServerContext, req: CompletionRequest, prompts: list[Prompt], params: SamplingParams,
                           request_id: str, arrival_time: float) -> dict:
    """Every prompt's beam search (side by side in the engine), its best n beams as the prompt's n choices."""
    check_beam_request(req)
    settings = beam_settings(ctx, req, params)
    outputs = await asyncio.gather(*(beam_search(ctx, f"{request_id}-{i}", p, settings, arrival_time)
                                     for i, p in enumerate(prompts)))
    requests.log_request(request_id, outputs, 200)
    choices = [_choice(ctx, req, p, out, c, i * params.n + c.index)
               for i, (p, out) in enumerate(zip(prompts, outputs)) for c in out.outputs]
    return {"id": request_id, "created": int(time.time()), "model": ctx.model_name, "object": "text_completion",
            "choices": choices, "usage": usage(outputs, ctx.options.enable_prompt_tokens_details)}


def _prompt_text(ctx: ServerContext, prompt: Prompt) -> str:
    """The echoed prompt: its text, or its ids decoded with their special tokens (as vLLM echoes them)."""
    if prompt.text is not None:
        return prompt.text
    return ctx.engine.tokenizer.decode(prompt.token_ids, skip_special_tokens=False)


def _echo_logprobs(ctx: ServerContext, req: CompletionRequest, prompt: Prompt, out: RequestOutput) -> dict:
    positions = out.prompt_logprobs or [None] * len(prompt.token_ids)
    return completion_logprobs(token_texts(ctx.texts, req), prompt.token_ids, positions, req.logprobs, 0)


def _choice(ctx: ServerContext, req: CompletionRequest, prompt: Prompt, out: RequestOutput, c: CompletionOutput,
            index: int) -> dict:
    prefix = _prompt_text(ctx, prompt) if req.echo else ""
    logprobs = None
    if req.logprobs is not None:
        logprobs = _echo_logprobs(ctx, req, prompt, out) if req.echo else None
        generated = completion_logprobs(token_texts(ctx.texts, req), c.token_ids, c.logprobs or [], req.logprobs,
                                        len(prefix), req.logprob_token_ids)
        logprobs = generated if logprobs is None else {k: logprobs[k] + generated[k] for k in generated}
    # vLLM sends the fields a request did not ask for as null (clients read them as attributes)
    return {"index": index, "text": prefix + c.text, "logprobs": logprobs,
            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
            "prompt_logprobs": (prompt_logprobs_json(token_texts(ctx.texts, req), out)
                                if req.prompt_logprobs is not None else None),
            "prompt_token_ids": list(out.prompt_token_ids) if req.return_token_ids else None,
            "token_ids": list(c.token_ids) if req.return_token_ids else None}


async def _stream(ctx: ServerContext, req: CompletionRequest, params: SamplingParams, prompts: list[Prompt],
                  streams: list[requests.RequestStream], head: dict) -> AsyncIterator[str]:
    head = {**head, "object": "text_completion"}
    n = params.n
    cursors = {}
    offsets = {}  # (prompt, choice) -> chars of echoed prompt text
    reporting = StreamUsage.of(req, ctx.options, sum(len(p.token_ids) for p in prompts))
    # Echoed prompts go first; with logprobs they wait for the prompt's logprobs (the engine's first output).
    echo_waits = req.echo and req.logprobs is not None
    echoed: set[int] = set()
    opened: set[tuple[int, int]] = set()  # choices whose first chunk went out (it carries prompt_token_ids)

    def token_fields(i: int, j: int, new_ids: list[int]) -> dict:
        """return_token_ids: the chunk's new token ids, and the prompt's ids on the choice's first chunk."""
        if not req.return_token_ids:
            return {}
        first = (i, j) not in opened
        opened.add((i, j))
        return {"token_ids": new_ids, **({"prompt_token_ids": list(prompts[i].token_ids)} if first else {})}

    def echo_chunks(i: int, out: RequestOutput | None) -> list[str]:
        echoed.add(i)
        text = _prompt_text(ctx, prompts[i])
        logprobs = _echo_logprobs(ctx, req, prompts[i], out) if out is not None else None
        chunks = []
        for j in range(n):
            offsets[i, j] = len(text)
            chunks.append(sse({**head, "choices": [{"index": i * n + j, "text": text, "logprobs": logprobs,
                                                    "finish_reason": None, "stop_reason": None,
                                                    **token_fields(i, j, [])}],
                               **reporting.chunk_fields(streams)}))
        return chunks

    if req.echo and not echo_waits:
        for i in range(len(prompts)):
            for chunk in echo_chunks(i, None):
                yield chunk
    async for i, out in requests.merged(streams):
        if req.echo and i not in echoed:
            for chunk in echo_chunks(i, out):
                yield chunk
        for c in out.outputs:
            cursor = cursors.setdefault((i, c.index), ChoiceCursor())
            sent_tokens = cursor.tokens
            chunk = _delta_choice(ctx, req, params, c, cursor, offsets.get((i, c.index), 0), i * n + c.index)
            if chunk is not None:
                chunk.update(token_fields(i, c.index, list(c.token_ids[sent_tokens : cursor.tokens])))
                yield sse({**head, "choices": [chunk], **reporting.chunk_fields(streams)})
    if reporting.final:  # per-request metrics ride on this chunk only, as in vLLM
        yield sse({**head, "choices": [], "usage": reporting.now(streams),
                   **_metrics(ctx, params, [s.last for s in streams])})


def _metrics(ctx: ServerContext, params: SamplingParams, outputs: list) -> dict:
    """--enable-per-request-metrics: one prompt's one sequence has timings that stand for the request."""
    if len(outputs) != 1:
        return {}
    return metrics_field(ctx.options.enable_per_request_metrics, params.n, outputs[0])


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
        logprobs = completion_logprobs(token_texts(ctx.texts, req), ids, positions, req.logprobs,
                                       echo_chars + start_chars, req.logprob_token_ids)
    cursor.tokens = len(c.token_ids)
    cursor.done = finished
    return {"index": index, "text": delta, "logprobs": logprobs, "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason}
