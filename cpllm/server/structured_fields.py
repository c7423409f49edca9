"""The request fields that constrain output (OpenAI's response_format, vLLM's structured_outputs and guided_*)
turned into one StructuredOutputsParams; a request may use only one of them."""

from __future__ import annotations

import dataclasses

from cpllm.server.errors import bad_request
from cpllm.server.protocol import SamplingFields
from cpllm.structured.params import StructuredOutputsParams


@dataclasses.dataclass(frozen=True, slots=True)
class Constraint:
    """A request's output constraint and the field it came from (for error messages)."""

    params: StructuredOutputsParams
    """The constraint."""
    param: str
    """The request field that set it, e.g. "response_format" or "guided_regex"."""


def request_constraint(req: SamplingFields) -> Constraint | None:
    """The constraint the request asks for, or None; 400 (naming the fields) for two at once or a bad value."""
    found = _sources(req)
    if len(found) > 1:
        raise bad_request(f"give only one way to constrain the output; got {', '.join(name for name, _ in found)}",
                          found[1][0])
    if not found:
        return None
    param, fields = found[0]
    try:
        return Constraint(params=StructuredOutputsParams(**fields), param=param)
    except ValueError as exc:
        raise bad_request(f"{param}: {exc}", param) from exc


def _sources(req: SamplingFields) -> list[tuple[str, dict]]:
    whitespace = {"whitespace_pattern": req.guided_whitespace_pattern} if req.guided_whitespace_pattern else {}
    found: list[tuple[str, dict]] = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", {"json_object": True, **whitespace}))
    elif fmt is not None and fmt.type == "json_schema":
        schema = fmt.json_schema.json_schema
        # OpenAI's structured outputs treat object schemas as closed (its strict mode; xgrammar does the same).
        found.append(("response_format", {"json": schema, "disable_additional_properties": True, **whitespace}
                      if schema is not None else {"json_object": True, **whitespace}))
    if req.structured_outputs is not None:
        so = req.structured_outputs
        fields = {"json": so.json_, "regex": so.regex, "choice": so.choice, "grammar": so.grammar,
                  "json_object": so.json_object, "whitespace_pattern": so.whitespace_pattern,
                  "disable_additional_properties": so.disable_additional_properties or None}
        fields = {k: v for k, v in fields.items() if v is not None}
        found.append(("structured_outputs", {**fields, "disable_any_whitespace": so.disable_any_whitespace}))
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar")):
        value = getattr(req, name)
        if value is not None:
            found.append((name, {kind: value, **(whitespace if kind == "json" else {})}))
    return found
