"""POST /v1/chat/completions: messages (and tools) through the model's chat template, streamed or not."""

from __future__ import annotations

import time
import uuid

from cpllm.engine.outputs import RequestOutput
from cpllm.engine.sampling_params import SamplingParams
from cpllm.server import requests
from cpllm.server.beam_search import beam_search, beam_settings, check_beam_request
from cpllm.server.async_engine import RequestStream
from cpllm.server.chat_run import ChatRun
from cpllm.server.chat_stream import chat_events, choice_message
from cpllm.server.errors import bad_request
from cpllm.server.forwarded_prompt import forwarded_prompt_ids
from cpllm.server.formatting import kv_transfer_answer, sampling_params, usage
from cpllm.server.prompt_fields import (bad_words_token_ids, check_allowed_token_ids, check_token_ids,
                                        prompt_logprobs_json, resolved_counts, token_texts, truncated)
from cpllm.server.protocol import ChatCompletionRequest
from cpllm.server.request_metrics import metrics_field
from cpllm.server.requests import Prompt, ServerContext
from cpllm.server.reasoning import Reasoning, thinks_from_start
from cpllm.server.structured_fields import Constraint, request_constraint
from cpllm.server.tool_calls import ToolPlan, plan_tools, tool_schema_constraints


def chat_prompt(ctx: ServerContext, req: ChatCompletionRequest, plan: ToolPlan) -> Prompt:
    """The rendered, tokenized and truncated prompt; a token-in request's own ids (prompt_token_ids), or the ids a
    disaggregated router forwards in kv_transfer_params, as given."""
    tokenizer = ctx.engine.tokenizer
    if req.prompt_token_ids is not None:
        _check_prompt_ids(req.prompt_token_ids, tokenizer.vocab_size)
        kept = truncated(list(req.prompt_token_ids), req, ctx.engine.max_model_len)
        return Prompt(token_ids=kept, text=None)
    forwarded = forwarded_prompt_ids(req, tokenizer.vocab_size)
    if forwarded is not None:  # the prefill stage's ids, forwarded by the router: no template runs
        return Prompt(token_ids=truncated(forwarded, req, ctx.engine.max_model_len), text=None)
    try:
        text = tokenizer.apply_chat_template(req.template_messages(), add_generation_prompt=req.add_generation_prompt,
                                             tools=plan.template_tools,
                                             continue_final_message=req.continue_final_message,
                                             chat_template=req.chat_template or ctx.options.chat_template,
                                             template_kwargs=req.chat_template_kwargs)
    except Exception as exc:  # noqa: BLE001 - jinja raises many kinds; all mean "these messages do not fit"
        param = "chat_template_kwargs" if isinstance(exc, TypeError) and req.chat_template_kwargs else "messages"
        raise bad_request(f"the chat template failed on these messages: {exc}", param) from exc
    token_ids = tokenizer.encode(text, add_special_tokens=req.add_special_tokens)
    kept = truncated(token_ids, req, ctx.engine.max_model_len)
    return Prompt(token_ids=kept, text=text if len(kept) == len(token_ids) else None)


def _check_prompt_ids(token_ids: list[int], vocab_size: int) -> None:
    if not token_ids:
        raise bad_request("prompt_token_ids is empty; send at least one token id", "prompt_token_ids")
    check_token_ids(token_ids, vocab_size, "prompt_token_ids")


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


async def start_chat(ctx: ServerContext, req: ChatCompletionRequest, request_id: str, arrival_time: float,
                     limit_param: str | None = None) -> ChatRun:
    """Tools planned and checked, prompt rendered, constraint compiled, and the request added to the engine.
    `limit_param` names the output limit in errors (default: the chat field the request used)."""
    req, limit = resolved_counts(ctx, req, ("top_logprobs", "prompt_logprobs"), wants_logprobs=req.logprobs)
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
                             bad_words_token_ids=bad_words_token_ids(ctx.engine.tokenizer, req.bad_words),
                             max_logprobs=limit)
    await requests.compile_constraint(ctx, constraint)
    streams = await requests.start(ctx, request_id, [prompt], params, arrival_time, limit_param)
    return ChatRun(plan=plan, params=params, streams=streams, request=req, prompt=prompt,
                   reasoning=_reasoning(ctx, req, plan, prompt))


def _reasoning(ctx: ServerContext, req: ChatCompletionRequest, plan: ToolPlan, prompt: Prompt) -> Reasoning | None:
    """The request's reasoning split, when the server has a parser and no tool call is forced."""
    parser = ctx.options.reasoning_parser
    if parser is None or plan.mode not in ("none", "auto"):
        return None
    tail = ctx.engine.tokenizer.decode(prompt.token_ids[-8:], skip_special_tokens=False)
    return Reasoning(in_thinking=thinks_from_start(parser, tail), include=req.include_reasoning)


async def create_chat_completion(ctx: ServerContext, req: ChatCompletionRequest, arrival_time: float):
    """A response dict, or an async iterator of server-sent events when req.stream."""
    request_id = f"chatcmpl-{req.request_id or uuid.uuid4().hex}"
    head = {"id": request_id, "created": int(time.time()), "model": ctx.model_name}
    if req.use_beam_search:
        return await _beam_chat(ctx, req, head, arrival_time)
    run = await start_chat(ctx, req, request_id, arrival_time)
    if run.request.stream:
        return requests.sse_events(head["id"], run.streams, chat_events(ctx, run, head))
    (output,) = await requests.finished(request_id, run.streams)
    return chat_response(ctx, run, output, head)


def chat_response(ctx: ServerContext, run: ChatRun, output: RequestOutput, head: dict) -> dict:
    """The whole response; the fields a request did not ask for are null, as vLLM sends them."""
    req = run.request
    choices = [choice_message(ctx, req, run.plan, c, req.top_logprobs or 0, run.reasoning) for c in output.outputs]
    for choice, c in zip(choices, output.outputs):
        choice["token_ids"] = list(c.token_ids) if req.return_token_ids else None
    return {**head, "object": "chat.completion", "choices": choices,
            "usage": usage([output], ctx.options.enable_prompt_tokens_details),
            "prompt_logprobs": (prompt_logprobs_json(token_texts(ctx.texts, req), output)
                                if req.prompt_logprobs is not None else None),
            "prompt_token_ids": list(output.prompt_token_ids) if req.return_token_ids else None,
            **kv_transfer_answer([output]), **metrics_field(ctx.options.enable_per_request_metrics, req.n, output)}


async def _beam_chat(ctx: ServerContext, req: ChatCompletionRequest, head: dict, arrival_time: float) -> dict:
    """A beam search over the rendered conversation; its best n beams are the n choices (no tools: a forced call
    is a grammar, which the search does not follow)."""
    check_beam_request(req)
    plan = plan_tools(req, ctx.options)
    prompt = chat_prompt(ctx, req, plan)
    limit_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    params = sampling_params(req, max_tokens=req.output_limit(), logprobs=None, max_tokens_param=limit_param,
                             max_n=ctx.options.max_n)
    output = await beam_search(ctx, head["id"], prompt, beam_settings(ctx, req, params), arrival_time)
    requests.log_request(head["id"], [output], 200)
    run = ChatRun(plan=plan, params=params, streams=[], request=req, prompt=prompt,
                  reasoning=_reasoning(ctx, req, plan, prompt))
    return chat_response(ctx, run, output, head)
