"""What the engine hands back to users, in vLLM's shape."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    """One token's log-probability; `rank` is 1 for the most likely token."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position: token id -> Logprob (the chosen token plus the top-k alternatives).
PositionLogprobs = dict[int, Logprob]


@dataclass(slots=True)
class CompletionOutput:
    """One sampled sequence of a request (there are `n` of them)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    """"stop" (EOS, stop id or stop string), "length" (max_tokens / max_model_len), "abort", or None while running."""
    stop_reason: int | str | None = None
    """The stop string or stop token id that ended the sequence, if any."""
    logprobs: list[PositionLogprobs] | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """The state of one request after a step (or its final result)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    """Prompt tokens read from the prefix cache instead of computed (the first sequence's, when first scheduled)."""
    metrics: "RequestMetrics" = field(default_factory=lambda: RequestMetrics())
    kv_transfer_params: dict | None = None
    """A prefill instance's answer to a do_remote_decode request, for the decode instance (docs/disaggregated.md)."""


@dataclass(slots=True)
class RequestMetrics:
    """Wall-clock timestamps (time.monotonic()) of a request's life."""

    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
