"""What a request constrains its output to: vLLM's StructuredOutputsParams (torch-free, llguidance-free)."""

from __future__ import annotations

import json as _json
from dataclasses import dataclass
from typing import Any

MAX_CHOICES = 4096
"""Most alternatives a `choice` constraint may list (each becomes a branch of the grammar)."""

_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True, kw_only=True, slots=True)
class StructuredOutputsParams:
    """Exactly one constraint on the generated text; the output then always matches it (unless cut by max_tokens)."""

    json: str | dict[str, Any] | None = None
    """A JSON schema (as a dict or as JSON text) the output must be an instance of."""
    regex: str | None = None
    """A regular expression (Rust `regex` syntax, close to Python's) the whole output must match."""
    choice: tuple[str, ...] | list[str] | None = None
    """The output is exactly one of these strings; a tuple after init."""
    grammar: str | None = None
    """A context-free grammar, in Lark syntax or llama.cpp's GBNF (detected from the text)."""
    json_object: bool | None = None
    """True: any JSON object (OpenAI's response_format {"type": "json_object"})."""
    disable_any_whitespace: bool = False
    """JSON without whitespace between tokens (compact output, and no runaway newlines from small models)."""
    whitespace_pattern: str | None = None
    """Regex for the whitespace allowed between JSON tokens; None = a bounded default (see grammar.py)."""
    disable_additional_properties: bool = False
    """JSON objects whose schema does not say otherwise get no properties beyond those listed (as OpenAI's strict
    mode and xgrammar do); the output still validates against the schema as given."""

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"structured outputs need exactly one of {', '.join(_KINDS)}; got {len(given)}"
                + (f" ({', '.join(given)})" if given else "")
            )
        if self.json is not None:
            object.__setattr__(self, "json", _schema(self.json))
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError(f"regex must be a non-empty string, got {self.regex!r}")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ValueError(f"grammar must be a non-empty string, got {self.grammar!r}")
        if self.choice is not None:
            object.__setattr__(self, "choice", _choices(self.choice))
        if self.json_object not in (None, True):
            raise ValueError(f"json_object must be true or left out, got {self.json_object!r}")
        if self.whitespace_pattern is not None and not isinstance(self.whitespace_pattern, str):
            raise ValueError(f"whitespace_pattern must be a string, got {self.whitespace_pattern!r}")

    @property
    def kind(self) -> str:
        """Which constraint is set: "json", "regex", "choice", "grammar" or "json_object"."""
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple:
        """A hashable, canonical description: equal keys compile to the same grammar (the cache key)."""
        value: Any = getattr(self, self.kind)
        if self.kind == "json":
            value = _json.dumps(value, sort_keys=True, separators=(",", ":"))
        return (self.kind, value, self.disable_any_whitespace, self.whitespace_pattern,
                self.disable_additional_properties)


GuidedDecodingParams = StructuredOutputsParams
"""vLLM's older name (SamplingParams(guided_decoding=GuidedDecodingParams(json=...)))."""


def _schema(value: Any) -> dict[str, Any] | bool:
    """The schema as a dict (or a boolean schema), parsed from text when it came as text."""
    if isinstance(value, str):
        try:
            value = _json.loads(value)
        except ValueError as exc:
            raise ValueError(f"json schema is not valid JSON: {exc}") from exc
    if not isinstance(value, (dict, bool)):
        raise ValueError(f"json schema must be a JSON object, got {type(value).__name__}")
    return value


def _choices(value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise ValueError(f"choice must be a list of strings, got {value!r}")
    if not 1 <= len(value) <= MAX_CHOICES:
        raise ValueError(f"choice must list 1 to {MAX_CHOICES} strings, got {len(value)}")
    for item in value:
        if not isinstance(item, str) or not item:
            raise ValueError(f"choice entries must be non-empty strings, got {item!r}")
    return tuple(value)
