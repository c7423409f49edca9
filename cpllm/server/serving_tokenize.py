"""vLLM's POST /tokenize (a prompt, or chat messages through the chat template) and POST /detokenize."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from cpllm.server.errors import bad_request, from_validation_error
from cpllm.server.protocol import ChatCompletionRequest
from cpllm.server.protocol_tokenize import DetokenizeRequest, TokenizeRequest
from cpllm.server.requests import ServerContext
from cpllm.server.serving_chat import chat_prompt
from cpllm.server.tool_calls import plan_tools


def tokenize(ctx: ServerContext, req: TokenizeRequest) -> dict[str, Any]:
    """{"count", "max_model_len", "tokens", "token_strs"}; the chat form renders exactly what a chat request would."""
    tokenizer = ctx.engine.tokenizer
    if req.prompt is not None:
        add_special = req.add_special_tokens if req.add_special_tokens is not None else True
        tokens = tokenizer.encode(req.prompt, add_special_tokens=add_special)
    else:
        try:
            chat = ChatCompletionRequest.model_validate(req.chat_fields())
        except ValidationError as exc:
            raise from_validation_error(exc) from exc
        tokens = chat_prompt(ctx, chat, plan_tools(chat, ctx.options)).token_ids
    token_strs = tokenizer.convert_ids_to_tokens(tokens) if req.return_token_strs else None
    return {"count": len(tokens), "max_model_len": ctx.engine.max_model_len, "tokens": tokens,
            "token_strs": token_strs}


def detokenize(ctx: ServerContext, req: DetokenizeRequest) -> dict[str, Any]:
    """{"prompt": text}; an id outside the vocabulary is a 400 naming it and the limit."""
    vocab_size = ctx.engine.tokenizer.vocab_size
    for index, token in enumerate(req.tokens):
        if token >= vocab_size:
            raise bad_request(f"tokens.{index}: token id {token} is outside the vocabulary (ids 0..{vocab_size - 1})",
                              f"tokens.{index}")
    return {"prompt": ctx.engine.tokenizer.decode(req.tokens, skip_special_tokens=False)}
