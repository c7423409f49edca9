"""Parsers of the tool calls a model writes as text (tool_choice="auto", --tool-call-parser).

Each parser answers two questions: what are the content and the calls of a finished
text (`extract`), and how much of a growing text is surely plain content, so a
stream can send it before the model has finished (`content_end`).
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any


@dataclasses.dataclass(frozen=True, slots=True)
class ParsedToolCall:
    """One call the model made."""

    name: str
    """The function's name."""
    arguments: str
    """Its arguments as JSON text (OpenAI's shape)."""


@dataclasses.dataclass(frozen=True, slots=True)
class ExtractedToolCalls:
    """A finished text split into what the user reads and the calls the model made."""

    content: str | None
    """Text outside the calls; None when there is none."""
    tool_calls: list[ParsedToolCall]
    """The calls, in order; empty when the text holds none (or none that parse)."""


def _no_calls(text: str) -> ExtractedToolCalls:
    return ExtractedToolCalls(content=text, tool_calls=[])


def _call_from(obj: Any, argument_keys: tuple[str, ...]) -> ParsedToolCall | None:
    """A call from {"name": ..., <argument key>: {...} or "..."}; None if the object is not shaped so."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments: Any = {}
    for key in argument_keys:
        if key in obj:
            arguments = obj[key]
            break
    if isinstance(arguments, str):  # some models write the arguments as a JSON string already
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedToolCall(name=obj["name"], arguments=json.dumps(arguments, ensure_ascii=False))


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker` (it may still become the marker)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0


class HermesToolParser:
    """Hermes / Qwen format: calls as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number of
    them, after optional plain text. A last call without its closing tag (the model stopped) still counts."""

    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    _CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def extract(self, text: str) -> ExtractedToolCalls:
        first = text.find(self.START)
        if first < 0:
            return _no_calls(text)
        calls = []
        for body in self._CALL.findall(text[first:]):
            try:
                call = _call_from(json.loads(body.strip()), ("arguments", "parameters"))
            except ValueError:
                call = None
            if call is None:  # a malformed call: show the model's text rather than guess
                return _no_calls(text)
            calls.append(call)
        content = text[:first]
        return ExtractedToolCalls(content=content if content.strip() else None, tool_calls=calls)

    def content_end(self, text: str) -> int:
        first = text.find(self.START)
        return first if first >= 0 else len(text) - _partial_suffix(text, self.START)


class Llama3JsonToolParser:
    """Llama 3.x JSON format: the whole answer is `{"name": ..., "parameters": {...}}` (or "arguments"), several
    separated by ";", optionally after the <|python_tag|> token. Any other text is plain content."""

    name = "llama3_json"
    PYTHON_TAG = "<|python_tag|>"

    def extract(self, text: str) -> ExtractedToolCalls:
        body = text.strip().removeprefix(self.PYTHON_TAG).strip()
        if not body.startswith("{"):
            return _no_calls(text)
        decoder, calls, pos = json.JSONDecoder(), [], 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except ValueError:
                return _no_calls(text)
            call = _call_from(obj, ("parameters", "arguments"))
            if call is None:
                return _no_calls(text)
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in " \t\r\n;":
                pos += 1
        return ExtractedToolCalls(content=None, tool_calls=calls)

    def content_end(self, text: str) -> int:
        stripped = text.lstrip()
        if not stripped:
            return 0  # nothing yet tells content from a call
        if stripped.startswith("{") or self.PYTHON_TAG.startswith(stripped[: len(self.PYTHON_TAG)]):
            return 0  # a call (or its start): hold everything back until the end
        return len(text)


ToolParser = HermesToolParser | Llama3JsonToolParser

PARSERS: dict[str, type[HermesToolParser] | type[Llama3JsonToolParser]] = {
    HermesToolParser.name: HermesToolParser,
    Llama3JsonToolParser.name: Llama3JsonToolParser,
}
"""--tool-call-parser name -> parser class."""


def get_parser(name: str) -> ToolParser:
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(PARSERS)}")
    return PARSERS[name]()
