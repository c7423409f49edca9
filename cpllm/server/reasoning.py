"""Reasoning parsers (--reasoning-parser): the thinking a model writes between <think> and </think> goes to the
message's `reasoning` / `reasoning_content`, the rest stays `content`, whole or streamed, as vLLM's parsers of the
same names split them.

deepseek_r1: DeepSeek-R1's template opens the thinking in the prompt, so the output starts inside it; everything
up to </think> is reasoning (all of it while no </think> came). qwen3: the model opens the thinking itself with
<think> (or the template did, as Qwen3's thinking-only releases do); an output that starts with neither is all
content (enable_thinking=false renders an empty thinking block in the prompt).
"""

from __future__ import annotations

import dataclasses

REASONING_PARSERS = ("deepseek_r1", "qwen3")
"""Names accepted by --reasoning-parser (vLLM's)."""
THINK_START = "<think>"
THINK_END = "</think>"


@dataclasses.dataclass(frozen=True, slots=True)
class ReasoningSplit:
    """An output's text, split: the reasoning so far, and where its content begins."""

    reasoning: str | None
    """The thinking text (without its tags); None when the output has no thinking."""
    content_start: int | None
    """Index in the text where the content begins; None while the model is still thinking (or, streamed, while
    the text could still become an opening tag)."""


def thinks_from_start(parser: str, prompt_tail: str) -> bool:
    """Whether the output starts inside the thinking: the prompt ends with an open <think>, or (deepseek_r1) always."""
    return parser == "deepseek_r1" or prompt_tail.rstrip().endswith(THINK_START)


def split_reasoning(text: str, *, in_thinking: bool, finished: bool) -> ReasoningSplit:
    """Splits `text` (the output so far); `in_thinking`: the output starts inside the thinking. While streaming
    (`finished` false) a tail that may be the start of a tag is held back from the reasoning."""
    body = text
    if not in_thinking:
        if not text.startswith(THINK_START):
            if not finished and THINK_START.startswith(text):
                return ReasoningSplit(reasoning=None, content_start=None)  # "", "<", "<th": not decided yet
            return ReasoningSplit(reasoning=None, content_start=0)
        body = text[len(THINK_START):]
    elif text.startswith(THINK_START):  # a model that writes the tag the prompt already opened
        body = text[len(THINK_START):]
    offset = len(text) - len(body)
    end = body.find(THINK_END)
    if end >= 0:
        return ReasoningSplit(reasoning=body[:end], content_start=offset + end + len(THINK_END))
    if not finished:
        body = body[: len(body) - _partial_tag(body)]
    return ReasoningSplit(reasoning=body, content_start=None)


def _partial_tag(text: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of </think>."""
    for size in range(min(len(THINK_END) - 1, len(text)), 0, -1):
        if text.endswith(THINK_END[:size]):
            return size
    return 0


@dataclasses.dataclass(frozen=True, slots=True)
class Reasoning:
    """How one chat request's output is split (a request runs without one when the server has no parser, or when
    a tool call is forced: the grammar then leaves no room for thinking)."""

    in_thinking: bool
    """The output starts inside the thinking (see thinks_from_start)."""
    include: bool
    """Return the reasoning (the request's include_reasoning); false drops it, the content stays as it is."""


def output_parts(reasoning: Reasoning, text: str, finished: bool) -> tuple[str | None, str | None]:
    """(reasoning to report, content text so far): the content is None while the model is still thinking."""
    split = split_reasoning(text, in_thinking=reasoning.in_thinking, finished=finished)
    content = text[split.content_start:] if split.content_start is not None else None
    return (split.reasoning if reasoning.include else None), content
