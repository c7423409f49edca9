"""A StructuredOutputsParams as an llguidance grammar (text that an LLMatcher compiles)."""

from __future__ import annotations

import json

import llguidance

from cpllm.structured.params import StructuredOutputsParams

ANY_JSON_OBJECT = {"type": "object"}
"""The schema of response_format {"type": "json_object"}."""

DEFAULT_JSON_WHITESPACE = r"\x20{0,4}(\x0D?\x0A(\x20{0,32}|\x09{0,8}))?"
"""Whitespace allowed between JSON tokens unless the request says otherwise: pretty-printing (one line break and
an indent per gap) but bounded, so a sampled small model cannot run away into thousands of tabs and newlines
(seen with unbounded whitespace and SmolLM2 at temperature 1)."""


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of `params`; ValueError when the grammar text cannot even be read."""
    kind = params.kind
    if kind in ("json", "json_object"):
        schema = params.json if kind == "json" else ANY_JSON_OBJECT
        if params.disable_additional_properties:
            schema = closed_objects(schema)
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=_json_options(params))
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        # Each choice is a JSON-quoted literal: Lark string syntax is JSON's.
        lark = "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice)
        return llguidance.LLMatcher.grammar_from_lark(lark)
    try:
        return llguidance.grammar_from("grammar", params.grammar)  # Lark as is; GBNF converted to Lark
    except Exception as exc:  # the GBNF converter raises its own error kinds
        raise ValueError(f"grammar could not be read: {exc}") from exc


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
"""Keywords whose value maps names to schemas (the map itself is not a schema)."""
_DATA_KEYWORDS = ("enum", "const", "default", "examples")
"""Keywords whose value is data, not a schema: left as given."""


def closed_objects(schema):
    """A copy of `schema` where every object schema that leaves additionalProperties open closes it."""
    if isinstance(schema, list):
        return [closed_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _DATA_KEYWORDS:
            out[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: closed_objects(sub) for name, sub in value.items()}
        else:
            out[key] = closed_objects(value)
    is_object = out.get("type") == "object" or "properties" in out
    if is_object and "additionalProperties" not in out and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    return out


def _json_options(params: StructuredOutputsParams) -> dict:
    if params.disable_any_whitespace:
        # Compact JSON; the separators keep the usual spaces so the text stays natural for a model.
        return {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    return {"whitespace_pattern": params.whitespace_pattern or DEFAULT_JSON_WHITESPACE}
