"""POST /v1/chat/completions: messages (and tools) through the model's chat template, streamed or not."""

from __future__ import annotations

import dataclasses
import time
import uuid

from cpllm.engine.sampling_params import SamplingParams
from cpllm.server import requests
from cpllm.server.async_engine import RequestStream
from cpllm.server.chat_stream import chat_events, choice_message
from cpllm.server.errors import bad_request
from cpllm.server.formatting import sampling_params, usage
from cpllm.server.prompt_fields import (bad_words_token_ids, check_allowed_token_ids, prompt_logprobs_json,
                                        token_texts, truncated)
from cpllm.server.protocol import ChatCompletionRequest
from cpllm.server.requests import Prompt, ServerContext
from cpllm.server.structured_fields import Constraint, request_constraint
from cpllm.server.tool_calls import ToolPlan, plan_tools, tool_schema_constraints


def chat_prompt(ctx: ServerContext, req: ChatCompletionRequest, plan: ToolPlan) -> Prompt:
    tokenizer = ctx.engine.tokenizer
    try:
        text = tokenizer.apply_chat_template(req.template_messages(), add_generation_prompt=req.add_generation_prompt,
                                             tools=plan.template_tools,
                                             continue_final_message=req.continue_final_message,
                                             chat_template=req.chat_template,
                                             template_kwargs=req.chat_template_kwargs)
    except Exception as exc:  # noqa: BLE001 - jinja raises many kinds; all mean "these messages do not fit"
        param = "chat_template_kwargs" if isinstance(exc, TypeError) and req.chat_template_kwargs else "messages"
        raise bad_request(f"the chat template failed on these messages: {exc}", param) from exc
    token_ids = tokenizer.encode(text, add_special_tokens=req.add_special_tokens)
    kept = truncated(token_ids, req, ctx.engine.max_model_len)
    return Prompt(token_ids=kept, text=text if len(kept) == len(token_ids) else None)


async def _check_tool_schemas(ctx: ServerContext, req: ChatCompletionRequest) -> None:
    """Every tool's parameter schema must compile, whatever tool_choice is (a forced one compiles it again, cached)."""
    for param, grammar in tool_schema_constraints(req):
        await requests.compile_constraint(ctx, Constraint(params=grammar, param=param))


def _constraint(req: ChatCompletionRequest, plan: ToolPlan) -> Constraint | None:
    """The output constraint: the forced tool call's, or the one the request asks for (not both)."""
    asked = request_constraint(req)
    if plan.constraint is None:
        return asked
    if asked is not None:
        raise bad_request(f"{asked.param} cannot be combined with tool_choice {plan.mode!r}, which fixes the "
                          "output to a tool call", asked.param)
    return Constraint(params=plan.constraint, param="tools")


@dataclasses.dataclass(frozen=True, slots=True)
class ChatRun:
    """A chat request started in the engine: what /v1/chat/completions and /v1/responses format from."""

    plan: ToolPlan
    """How the request uses its tools."""
    params: SamplingParams
    """Its sampling params."""
    streams: list[RequestStream]
    """Its one engine request's stream."""


async def start_chat(ctx: ServerContext, req: ChatCompletionRequest, request_id: str, arrival_time: float,
                     limit_param: str | None = None) -> ChatRun:
    """Tools planned and checked, prompt rendered, constraint compiled, and the request added to the engine.
    `limit_param` names the output limit in errors (default: the chat field the request used)."""
    plan = plan_tools(req, ctx.options)
    constraint = _constraint(req, plan)
    await _check_tool_schemas(ctx, req)
    check_allowed_token_ids(req, ctx.engine.tokenizer.vocab_size)
    prompt = chat_prompt(ctx, req, plan)
    if limit_param is None:
        limit_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    num_top = req.top_logprobs or 0
    params = sampling_params(req, max_tokens=req.output_limit(), logprobs=num_top if req.logprobs else None,
                             max_tokens_param=limit_param, max_n=ctx.options.max_n,
                             structured=constraint.params if constraint else None,
                             prompt_logprobs=req.prompt_logprobs,
                             bad_words_token_ids=bad_words_token_ids(ctx.engine.tokenizer, req.bad_words))
    await requests.compile_constraint(ctx, constraint)
    streams = await requests.start(ctx, request_id, [prompt], params, arrival_time, limit_param)
    return ChatRun(plan=plan, params=params, streams=streams)


async def create_chat_completion(ctx: ServerContext, req: ChatCompletionRequest, arrival_time: float):
    """A response dict, or an async iterator of server-sent events when req.stream."""
    request_id = f"chatcmpl-{req.request_id or uuid.uuid4().hex}"
    run = await start_chat(ctx, req, request_id, arrival_time)
    plan, params, streams, num_top = run.plan, run.params, run.streams, req.top_logprobs or 0
    head = {"id": request_id, "created": int(time.time()), "model": ctx.model_name}
    if req.stream:
        return requests.sse_events(head["id"], streams, chat_events(ctx, req, params, plan, streams, head))
    (output,) = await requests.finished(request_id, streams)
    choices = [choice_message(ctx, req, plan, c, num_top) for c in output.outputs]
    response = {**head, "object": "chat.completion", "choices": choices, "usage": usage([output])}
    if req.prompt_logprobs is not None:
        response["prompt_logprobs"] = prompt_logprobs_json(token_texts(ctx.texts, req), output)
    if req.return_token_ids:
        response["prompt_token_ids"] = list(output.prompt_token_ids)
        for choice, c in zip(choices, output.outputs):
            choice["token_ids"] = list(c.token_ids)
    return response
