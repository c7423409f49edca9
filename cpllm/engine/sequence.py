"""Driver-side bookkeeping of a user request: its n sequences, their text, logprobs and timing."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from cpllm.engine.detokenizer import IncrementalDetokenizer
from cpllm.engine.outputs import CompletionOutput, PositionLogprobs, RequestMetrics, RequestOutput
from cpllm.engine.request import Request, RequestStatus


@dataclass(eq=False)
class Sequence:
    """One of a request's n samples: the scheduler's Request plus what only the driver needs."""

    index: int
    request: Request
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None
    logprobs: list[PositionLogprobs] | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.request.status.finished

    def completion(self) -> CompletionOutput:
        status = self.request.status
        return CompletionOutput(
            index=self.index,
            text=self.detokenizer.text,
            token_ids=list(self.request.output_token_ids),
            finish_reason=status.value if status.finished else None,
            stop_reason=self.stop_reason,
            logprobs=self.logprobs,
        )


@dataclass(eq=False)
class RequestState:
    """A user request as the engine tracks it until every sequence has finished."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[Sequence]
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)

    @property
    def finished(self) -> bool:
        return all(seq.finished for seq in self.sequences)

    def output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[seq.completion() for seq in self.sequences],
            finished=self.finished,
            prompt_logprobs=self.prompt_logprobs,
            num_cached_tokens=self.sequences[0].request.num_cached_tokens or 0,
            metrics=self.metrics,
        )

    def mark_first_token(self) -> None:
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = time.monotonic()

    def mark_finished_if_done(self) -> None:
        if self.finished and self.metrics.finished_time is None:
            self.metrics.finished_time = time.monotonic()


def finish_status(seq: Sequence, token_id: int, eos_token_ids: tuple[int, ...], max_len: int) -> RequestStatus | None:
    """Why the sequence ends after sampling `token_id` (already appended), or None if it goes on."""
    request, params = seq.request, seq.request.sampling_params
    num_out = len(request.output_token_ids)
    may_stop = num_out >= params.min_tokens
    if may_stop and not params.ignore_eos and token_id in eos_token_ids:
        return RequestStatus.FINISHED_STOPPED
    if may_stop and token_id in params.stop_token_ids:
        seq.stop_reason = token_id
        return RequestStatus.FINISHED_STOPPED
    stop_string = seq.detokenizer.append(token_id)
    if stop_string is not None:
        seq.stop_reason = stop_string
        return RequestStatus.FINISHED_STOPPED
    limit = params.max_tokens if params.max_tokens is not None else max_len
    if num_out >= limit or request.num_tokens >= max_len:
        return RequestStatus.FINISHED_LENGTH
    return None
