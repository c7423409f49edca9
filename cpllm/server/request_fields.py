"""Request-level field rules shared by the chat and completion bodies: explicit nulls, unknown fields, and the vLLM
fields this server knows but does not implement (refused with a 400 naming them rather than silently dropped)."""

from __future__ import annotations

import logging
from typing import Any

from cpllm.server.errors import FieldError

logger = logging.getLogger("cpllm.server.protocol")

REFUSED: dict[str, tuple[Any, str]] = {
    "suffix": (None, "suffix (text after the insertion point) is not supported by this server"),
    "prompt_embeds": (None, "prompt embeddings are not supported; send text or token ids"),
    "logits_processors": (None, "custom logits processors are not supported"),
    "documents": (None, "documents (retrieval-augmented templates) are not supported"),
    "mm_processor_kwargs": (None, "multimodal inputs are not supported"),
    "priority": (0, "priority scheduling is not supported; leave priority at 0"),
    "cache_salt": (None, "cache_salt is not supported: the prefix cache is shared by every request"),
    "vllm_xargs": (None, "vllm_xargs is not supported"),
}
"""vLLM request field -> (the one value accepted, why any other is refused)."""

IGNORED = frozenset({"reasoning_effort", "include_reasoning", "guided_decoding_backend", "user", "metadata", "store",
                     "service_tier", "prediction", "modalities", "audio", "verbosity", "web_search_options"})
"""Fields accepted without effect (no reasoning parser, one backend, OpenAI-platform bookkeeping); not warned about."""


def normalise_body(data: Any, known: set[str]) -> Any:
    """The body with explicit nulls removed (null = the field's default, as SDKs in other languages send it),
    a 400 for a refused field set to anything but its accepted value, and one warning naming unknown fields."""
    if not isinstance(data, dict):
        return data
    data = {k: v for k, v in data.items() if v is not None}
    if data.get("prompt_embeds") in ([], "", {}):  # no embeddings given (vLLM's clients send []): as if absent
        del data["prompt_embeds"]
    for name, (accepted, reason) in REFUSED.items():
        if name in data and data[name] != accepted and not (name == "suffix" and data[name] == ""):
            raise FieldError(f"{name}: {reason}", name)
    unknown = sorted(k for k in data if k not in known and k not in REFUSED and k not in IGNORED)
    if unknown:
        logger.warning("the request has fields this server does not know, ignored: %s", ", ".join(unknown))
    return data
