"""Which usage a streamed response carries: a last chunk with the whole request's (stream_options.include_usage),
the usage so far on every chunk (stream_options.continuous_usage_stats), or both whatever the request says
(--enable-force-include-usage)."""

from __future__ import annotations

import dataclasses

from cpllm.server.async_engine import RequestStream
from cpllm.server.formatting import usage
from cpllm.server.options import ServeOptions
from cpllm.server.protocol import SamplingFields


@dataclasses.dataclass(kw_only=True, frozen=True, slots=True)
class StreamUsage:
    """A stream's usage reporting."""

    final: bool
    """Send a last chunk, with no choices, carrying the whole request's usage (the other chunks say null)."""
    continuous: bool
    """Every chunk carries the usage so far."""
    details: bool
    """Usage includes prompt_tokens_details (--enable-prompt-tokens-details)."""
    prompt_tokens: int
    """The request's prompt tokens (known before any output arrives)."""

    @classmethod
    def of(cls, req: SamplingFields, options: ServeOptions, prompt_tokens: int) -> "StreamUsage":
        asked = req.stream_options
        forced = options.enable_force_include_usage
        final = forced or (asked is not None and asked.include_usage)
        continuous = forced or (final and asked is not None and asked.continuous_usage_stats)
        return cls(final=final, continuous=continuous, details=options.enable_prompt_tokens_details,
                   prompt_tokens=prompt_tokens)

    def now(self, streams: list[RequestStream]) -> dict:
        """The usage so far: every prompt, and the tokens each choice has generated up to now."""
        return usage([s.last for s in streams if s.last is not None], self.details, self.prompt_tokens)

    def chunk_fields(self, streams: list[RequestStream]) -> dict:
        """The `usage` of a chunk with choices: the usage so far, null (a last chunk will say), or left out."""
        if self.continuous:
            return {"usage": self.now(streams)}
        return {"usage": None} if self.final else {}
