"""Decode-side prompt reuse in disaggregated serving: vLLM's router forwards the prefill stage's prompt token ids
as `kv_transfer_params["prompt_token_ids"]`, and the decode stage's chat route takes them as the prompt instead of
rendering and tokenizing the request's messages again (vLLM 0.33's OnlineRenderer does the same)."""

from __future__ import annotations

from cpllm.server.errors import bad_request
from cpllm.server.prompt_fields import check_token_ids
from cpllm.server.protocol import ChatCompletionRequest

PARAM = "kv_transfer_params.prompt_token_ids"


def forwarded_prompt_ids(req: ChatCompletionRequest, vocab_size: int) -> list[int] | None:
    """The forwarded ids, removed from kv_transfer_params (so the engine's connector never sees them); None when
    there are none, or when echo is set (echo needs the messages rendered, so vLLM ignores the ids then).
    Malformed ids are a 400 naming `kv_transfer_params.prompt_token_ids`."""
    kv = req.kv_transfer_params
    if not isinstance(kv, dict) or kv.get("prompt_token_ids") is None:
        return None
    ids = kv.pop("prompt_token_ids")
    if not kv:
        req.kv_transfer_params = None  # nothing left for the connector
    if req.echo:
        return None
    # bool is an int subclass, so the type is checked exactly
    if not isinstance(ids, list) or not ids or any(type(x) is not int or x < 0 for x in ids):
        raise bad_request(f"{PARAM} must be a non-empty list of non-negative integers", PARAM)
    check_token_ids(ids, vocab_size, PARAM)
    return ids
