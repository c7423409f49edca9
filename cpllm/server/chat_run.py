"""A chat request started in the engine: what /v1/chat/completions (serving_chat.py, chat_stream.py), its batch
route and /v1/responses format their answers from."""

from __future__ import annotations

import dataclasses

from cpllm.engine.sampling_params import SamplingParams
from cpllm.server.async_engine import RequestStream
from cpllm.server.protocol import ChatCompletionRequest
from cpllm.server.reasoning import Reasoning
from cpllm.server.requests import Prompt
from cpllm.server.tool_calls import ToolPlan


@dataclasses.dataclass(frozen=True, slots=True)
class ChatRun:
    """A chat request started in the engine: what /v1/chat/completions and /v1/responses format from."""

    plan: ToolPlan
    """How the request uses its tools."""
    params: SamplingParams
    """Its sampling params."""
    streams: list[RequestStream]
    """Its one engine request's stream."""
    request: ChatCompletionRequest
    """The request as run (its logprobs counts resolved: -1 became the vocabulary size)."""
    prompt: Prompt
    """The prompt the engine got."""
    reasoning: Reasoning | None = None
    """How its output's thinking is split off (--reasoning-parser); None: not at all."""
