"""POST /v1/chat/completions/batch (vLLM's: several conversations under one set of fields, answered in one response
with one choice per conversation) and POST /invocations (SageMaker's single route: a chat or a completion request,
told apart by its fields)."""

from __future__ import annotations

import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from cpllm.server import requests
from cpllm.server.errors import APIError, bad_request, from_validation_error
from cpllm.server.formatting import usage
from cpllm.server.protocol import ChatCompletionRequest, CompletionRequest
from cpllm.server.requests import ServerContext
from cpllm.server.serving_chat import ChatRun, chat_response, create_chat_completion, start_chat
from cpllm.server.serving_completion import create_completion


class BatchChatCompletionRequest(BaseModel):
    """A chat request whose `messages` is a list of conversations; every other field applies to each of them."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: list[list[dict[str, Any]]]
    """The conversations, each a list of chat messages."""


class InvocationRequest(BaseModel):
    """Any body of /v1/chat/completions (it has `messages`) or /v1/completions (it has `prompt`)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None


def _conversation(body: dict[str, Any], messages: list[dict[str, Any]], index: int) -> ChatCompletionRequest:
    """One conversation's chat request; an invalid one is a 400 whose param says which (`messages.1.0.content`)."""
    try:
        return ChatCompletionRequest.model_validate({**body, "messages": messages})
    except ValidationError as exc:
        error = from_validation_error(exc)
    if error.param is not None and error.param.startswith("messages"):
        where = f"messages.{index}" + error.param.removeprefix("messages")
        error = bad_request(error.message.replace(error.param, where, 1), where)
    raise error


async def create_batch_chat_completion(ctx: ServerContext, batch: BatchChatCompletionRequest,
                                       arrival_time: float) -> dict[str, Any]:
    """One response: conversation i's choices at indices i*n .. i*n+n-1, and the usage of them all."""
    body = batch.model_dump()
    if not batch.messages:
        raise bad_request("messages must hold at least one conversation (a list of messages)", "messages")
    if body.get("stream"):
        raise bad_request("stream is not supported by /v1/chat/completions/batch; stream each conversation "
                          "from /v1/chat/completions", "stream")
    if body.get("prompt_logprobs") is not None:  # a per-prompt field: one response has no place for it
        raise bad_request("prompt_logprobs is not supported by /v1/chat/completions/batch; send the conversation "
                          "to /v1/chat/completions", "prompt_logprobs")
    if isinstance(body.get("kv_transfer_params"), dict) and body["kv_transfer_params"].get("prompt_token_ids"):
        raise bad_request("kv_transfer_params.prompt_token_ids is not supported by /v1/chat/completions/batch: "
                          "one pre-tokenized prompt cannot serve several conversations",
                          "kv_transfer_params.prompt_token_ids")
    chats = [_conversation(body, messages, i) for i, messages in enumerate(batch.messages)]
    base_id = f"chatcmpl-{chats[0].request_id or uuid.uuid4().hex}"
    runs: list[ChatRun] = []
    try:
        for i, chat in enumerate(chats):
            runs.append(await start_chat(ctx, chat, f"{base_id}-{i}", arrival_time))
    except BaseException:
        for run in runs:  # one conversation refused: none of them stays in flight
            requests.close(base_id, run.streams, log=False)
        raise
    outputs = await requests.finished(base_id, [run.streams[0] for run in runs])
    head = {"id": base_id, "created": int(time.time()), "model": ctx.model_name}
    choices = []
    for i, (run, output) in enumerate(zip(runs, outputs)):
        for choice in chat_response(ctx, run, output, head)["choices"]:
            choices.append({**choice, "index": i * run.params.n + choice["index"]})
    # return_token_ids: each choice carries its generated ids (chat_response); the prompts' ids have no place in
    # one response, so prompt_token_ids stays null, as in vLLM's batch route
    return {**head, "object": "chat.completion", "choices": choices, "prompt_logprobs": None,
            "prompt_token_ids": None, "usage": usage(outputs, ctx.options.enable_prompt_tokens_details)}


async def create_invocation(ctx: ServerContext, invocation: InvocationRequest, arrival_time: float):
    """A chat completion when the body has `messages`, a completion when it has `prompt`, as vLLM routes them."""
    body = invocation.model_dump()
    if "messages" in body:
        return await create_chat_completion(ctx, _validated(ChatCompletionRequest, body), arrival_time)
    if "prompt" in body:
        return await create_completion(ctx, _validated(CompletionRequest, body), arrival_time)
    raise APIError(400, "/invocations needs a chat request (with messages) or a completion request (with prompt)",
                   param="messages", code="invalid_value")


def _validated(model: type[BaseModel], body: dict[str, Any]):
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise from_validation_error(exc) from exc
