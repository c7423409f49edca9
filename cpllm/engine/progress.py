"""The progress of one generate call on a terminal: prompt tokens prefilled, tokens generated, requests done.

Two parts, so that each is tested without a terminal or an engine. `RequestTally` is fed plain numbers after each
engine step (a request's prompt tokens cached, its output tokens, whether it finished) and sums them into one
`ProgressCounts`. `GenerateBars` draws counts as tqdm bars, which show the count, its rate and the time left.
`terminal_bars` gives the bars' factory only where the stream is a terminal: nothing is drawn into a pipe, a
file or a CI log (docs/architecture.md, "Progress of long prompts").
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any

BarFactory = Callable[..., Any]
"""Makes one bar: called as tqdm is (total=, desc=, unit=, position=, leave=); vLLM's `use_tqdm` callable."""


@dataclass(frozen=True)
class ProgressCounts:
    """What a generate call has done so far, summed over its requests."""

    prompt_tokens_done: int
    """Prompt tokens whose K/V are in the cache (prefix-cache hits included), each request's at most its prompt."""
    prompt_tokens_total: int
    """Prompt tokens of every request."""
    output_tokens: int
    """Tokens generated, over every sample of every request."""
    output_tokens_total: int | None
    """The most tokens the call can generate (max_tokens x n, summed); None when a request has no max_tokens."""
    requests_done: int
    """Requests finished."""
    requests_total: int
    """Requests of the call."""


@dataclass
class _Tally:
    prompt_len: int
    max_output: int | None
    prompt_done: int = 0
    output: int = 0
    finished: bool = False


class RequestTally:
    """Per-request counts of one generate call, updated from the numbers the engine reports after each step."""

    def __init__(self, requests: dict[str, tuple[int, int | None]]):
        """requests: request id -> (prompt tokens, most output tokens or None)."""
        for request_id, (prompt_len, max_output) in requests.items():
            if prompt_len < 1:
                raise ValueError(f"request {request_id!r} has a prompt of {prompt_len} tokens; at least 1 is needed")
            if max_output is not None and max_output < 0:
                raise ValueError(f"request {request_id!r} has max_output={max_output}; it must be >= 0")
        self._requests = {rid: _Tally(p, m) for rid, (p, m) in requests.items()}

    def prompt_computed(self, request_id: str, tokens: int) -> None:
        """The request has `tokens` of its prompt cached. The count never goes back: a preempted request computes
        its prompt again, and the bar counts the prompt once. Ids of other calls' requests are ignored."""
        tally = self._requests.get(request_id)
        if tally is not None:
            tally.prompt_done = max(tally.prompt_done, min(tokens, tally.prompt_len))

    def output(self, request_id: str, output_tokens: int, finished: bool) -> None:
        """The request's state after a step: its tokens generated (all samples) and whether it finished. A
        request that has an output has computed its whole prompt (an engine that does not report prompt tokens,
        the spawned DP front's, is counted prompt by prompt this way)."""
        tally = self._requests.get(request_id)
        if tally is None:
            return
        tally.prompt_done = tally.prompt_len
        tally.output = max(tally.output, output_tokens)
        tally.finished = tally.finished or finished

    def counts(self) -> ProgressCounts:
        tallies = self._requests.values()
        maxima = [t.max_output for t in tallies]
        return ProgressCounts(
            prompt_tokens_done=sum(t.prompt_done for t in tallies),
            prompt_tokens_total=sum(t.prompt_len for t in tallies),
            output_tokens=sum(t.output for t in tallies),
            output_tokens_total=None if None in maxima else sum(maxima),
            requests_done=sum(t.finished for t in tallies),
            requests_total=len(self._requests),
        )


def terminal_bars(stream: IO[str] | None = None) -> BarFactory | None:
    """tqdm bars on `stream` (default stderr) when it is a terminal, else None (nothing to draw)."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    if isatty is None or not isatty():
        return None
    from tqdm import tqdm  # only when bars are drawn

    return functools.partial(tqdm, file=stream, dynamic_ncols=True)


class GenerateBars:
    """The bars of one generate call: prompt tokens, tokens generated, and the requests done when there are
    several. `update` sets each bar to the counts (bars only move forward; the counts only grow)."""

    def __init__(self, factory: BarFactory, counts: ProgressCounts):
        self._factory = factory
        self._bars: dict[str, Any] = {}
        self._bars["prompt"] = factory(total=counts.prompt_tokens_total, desc="prompt", unit="tok",
                                       position=0, leave=True)
        if counts.requests_total > 1:
            self._bars["requests"] = factory(total=counts.requests_total, desc="requests", unit="req",
                                             position=2, leave=True)
        self.update(counts)

    def update(self, counts: ProgressCounts) -> None:
        if "output" not in self._bars and counts.output_tokens > 0:
            # made at the first token, its clock starts there: the rate and time left are the decode's, not
            # diluted by the prefill (the first tokens are its `initial`, outside the rate)
            self._bars["output"] = self._factory(total=counts.output_tokens_total, desc="output", unit="tok",
                                                 initial=counts.output_tokens, position=1, leave=True)
        shown = {"prompt": counts.prompt_tokens_done, "output": counts.output_tokens,
                 "requests": counts.requests_done}
        for name, bar in self._bars.items():
            if shown[name] > bar.n:
                bar.update(shown[name] - bar.n)

    def close(self, counts: ProgressCounts) -> None:
        """Once every request has finished, the output bar's total becomes what was generated: a request that
        stopped before max_tokens (EOS, a stop string) leaves the bar full, not short of a limit never reached."""
        output = self._bars.get("output")
        if output is not None and counts.requests_done == counts.requests_total \
                and output.total != counts.output_tokens:
            output.total = counts.output_tokens
            output.refresh()
        for bar in self._bars.values():
            bar.close()


class GenerateProgress:
    """A tally and its bars: what `LLM.generate` keeps while its requests run."""

    def __init__(self, factory: BarFactory, requests: dict[str, tuple[int, int | None]]):
        self.tally = RequestTally(requests)
        self.bars = GenerateBars(factory, self.tally.counts())

    def after_step(self, prompt_tokens: dict[str, int], outputs: list[tuple[str, int, bool]]) -> None:
        """prompt_tokens: request id -> prompt tokens cached; outputs: (request id, output tokens, finished)."""
        for request_id, tokens in prompt_tokens.items():
            self.tally.prompt_computed(request_id, tokens)
        for request_id, output_tokens, finished in outputs:
            self.tally.output(request_id, output_tokens, finished)
        self.bars.update(self.tally.counts())

    def close(self) -> None:
        self.bars.close(self.tally.counts())
