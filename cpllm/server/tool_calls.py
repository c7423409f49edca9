"""What tool_choice means for one chat request: the tools the template sees, the grammar that forces a call,
and how the finished text becomes OpenAI `tool_calls`.

- "none": the template sees the tools; the text is returned as content.
- "auto": the model decides; its text is parsed by --tool-call-parser (needs --enable-auto-tool-choice). A text
  that calls a function the request did not declare is returned as content, not as calls; with
  parallel_tool_calls=false only the first call is kept.
- "required": the output is forced to a JSON list of {"name", "parameters"} objects, one schema per tool
  (vLLM's format), so every call names a given tool and its arguments validate against that tool's schema.
- a named function: the output is forced to that function's arguments (its JSON schema).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import uuid
from typing import Any, Literal

from cpllm.server.errors import bad_request
from cpllm.server.options import ServeOptions
from cpllm.server.protocol import ChatCompletionRequest
from cpllm.server.protocol_tools import NamedToolChoice, parameters_schema, tool_schemas
from cpllm.server.tool_parsers import ExtractedToolCalls, ParsedToolCall, ToolParser, get_parser
from cpllm.structured.params import StructuredOutputsParams

Mode = Literal["none", "auto", "required", "named"]


@dataclasses.dataclass(frozen=True, slots=True)
class ToolPlan:
    """How one request uses its tools."""

    mode: Mode
    """What tool_choice resolved to."""
    template_tools: list[dict[str, Any]] | None = None
    """The tools handed to the chat template (None when the request has none)."""
    constraint: StructuredOutputsParams | None = None
    """The grammar that forces the call ("required" and named)."""
    function: str | None = None
    """The forced function's name (named)."""
    parser: ToolParser | None = None
    """The parser of the model's own calls ("auto")."""
    declared: frozenset[str] = frozenset()
    """The functions the request declared ("auto" keeps only calls to these)."""
    parallel: bool = True
    """parallel_tool_calls: False keeps only the first call ("auto")."""

    def extract(self, text: str) -> ExtractedToolCalls:
        """The content and calls of a finished choice."""
        if self.mode == "named":
            try:
                json.loads(text)
            except ValueError:  # cut short by max_tokens: no complete call to report (as vLLM, and as "required")
                return ExtractedToolCalls(content=text, tool_calls=[])
            return ExtractedToolCalls(content=None, tool_calls=[ParsedToolCall(self.function, text)])
        if self.mode == "required":
            return _required_calls(text)
        if self.mode == "auto":
            return self._auto_calls(text)
        return ExtractedToolCalls(content=text, tool_calls=[])


    def _auto_calls(self, text: str) -> ExtractedToolCalls:
        extracted = self.parser.extract(text)
        if any(call.name not in self.declared for call in extracted.tool_calls):
            return ExtractedToolCalls(content=text, tool_calls=[])  # not a call this request can run: show the text
        if not self.parallel and len(extracted.tool_calls) > 1:
            return ExtractedToolCalls(content=extracted.content, tool_calls=extracted.tool_calls[:1])
        return extracted


def plan_tools(req: ChatCompletionRequest, options: ServeOptions) -> ToolPlan:
    """The request's ToolPlan; 400 for a tool_choice that cannot be honoured."""
    choice = req.tool_choice
    if not req.tools:
        if choice in (None, "none", "auto"):
            return ToolPlan(mode="none")
        raise bad_request("tool_choice needs tools: the request lists none", "tool_choice")
    tools = tool_schemas(req.tools)
    if choice is None:  # OpenAI's default with tools is "auto"; without a parser the text stays content
        choice = "auto" if options.enable_auto_tool_choice else "none"
    if choice == "none":
        return ToolPlan(mode="none", template_tools=tools)
    if choice == "auto":
        if not options.enable_auto_tool_choice:
            raise bad_request('tool_choice "auto" needs the server to run with --enable-auto-tool-choice and '
                              "--tool-call-parser", "tool_choice")
        return ToolPlan(mode="auto", template_tools=tools, parser=get_parser(options.tool_call_parser),
                        declared=frozenset(t.function.name for t in req.tools), parallel=req.parallel_tool_calls)
    if choice == "required":
        return ToolPlan(mode="required", template_tools=tools,
                        constraint=_constraint(_required_schema(req)))
    return _named(req, choice, tools)


def _named(req: ChatCompletionRequest, choice: NamedToolChoice, tools: list[dict[str, Any]]) -> ToolPlan:
    by_name = {t.function.name: t.function for t in req.tools}
    function = by_name.get(choice.function.name)
    if function is None:
        raise bad_request(f"tool_choice names the function {choice.function.name!r}, which is not among the "
                          f"tools ({', '.join(by_name)})", "tool_choice")
    return ToolPlan(mode="named", template_tools=tools, function=function.name,
                    constraint=_constraint(parameters_schema(function)))


def tool_schema_constraints(req: ChatCompletionRequest) -> list[tuple[str, StructuredOutputsParams]]:
    """(param, grammar) of every declared tool's parameters, so each schema is checked whatever tool_choice is."""
    return [(f"tools.{i}.function.parameters", _constraint(parameters_schema(t.function)))
            for i, t in enumerate(req.tools or [])]


def _constraint(schema: dict[str, Any]) -> StructuredOutputsParams:
    # Compact JSON: a forced call has no use for free whitespace, and small models loop on it; closed objects,
    # as OpenAI's strict function calling: no invented arguments.
    return StructuredOutputsParams(json=schema, disable_any_whitespace=True, disable_additional_properties=True)


def _required_schema(req: ChatCompletionRequest) -> dict[str, Any]:
    defs: dict[str, Any] = {}
    calls = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [t.function.name]},
                             "parameters": _hoisted(parameters_schema(t.function), f"tool{i}_", defs)},
              "required": ["name", "parameters"], "additionalProperties": False}
             for i, t in enumerate(req.tools)]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else
                              {"anyOf": calls}}
    if not req.parallel_tool_calls:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _hoisted(schema: dict[str, Any], prefix: str, defs: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameters schema made to work nested inside the combined one: its own `$defs` / `definitions`
    move to the root's `$defs` (names prefixed, so tools cannot collide) and its local `$ref`s follow them; a `$ref`
    to its root ("#") points at a copy of it there."""
    schema = copy.deepcopy(schema)
    moved: dict[str, str] = {}
    for key in ("$defs", "definitions"):
        for name, sub in (schema.pop(key, None) or {}).items():
            new = f"{prefix}{key.lstrip('$')}_{name}"
            moved[f"#/{key}/{name}"] = f"#/$defs/{new}"
            defs[new] = sub
    root = f"#/$defs/{prefix}root"

    def rewrite(node: Any) -> Any:
        if isinstance(node, dict):
            out = {k: rewrite(v) for k, v in node.items()}
            ref = out.get("$ref")
            if isinstance(ref, str):
                if ref == "#":
                    out["$ref"] = root
                else:
                    out["$ref"] = next((target + ref[len(old):] for old, target in moved.items()
                                        if ref == old or ref.startswith(old + "/")), ref)
            return out
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        return node

    for name in [n for n in defs if n.startswith(prefix)]:
        defs[name] = rewrite(defs[name])
    hoisted = rewrite(schema)
    if _refers_to(hoisted, root) or any(_refers_to(defs[n], root) for n in defs if n.startswith(prefix)):
        defs[f"{prefix}root"] = hoisted
    return hoisted


def _refers_to(node: Any, ref: str) -> bool:
    if isinstance(node, dict):
        return node.get("$ref") == ref or any(_refers_to(v, ref) for v in node.values())
    if isinstance(node, list):
        return any(_refers_to(v, ref) for v in node)
    return False


def _required_calls(text: str) -> ExtractedToolCalls:
    try:
        items = json.loads(text)
    except ValueError:  # cut short by max_tokens: no complete call to report
        return ExtractedToolCalls(content=text, tool_calls=[])
    calls = [ParsedToolCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False)) for item in items]
    return ExtractedToolCalls(content=None, tool_calls=calls)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call_dicts(calls: list[ParsedToolCall], first_index: int = 0) -> list[dict[str, Any]]:
    """OpenAI's message.tool_calls (with `index`, which stream deltas need and full messages tolerate)."""
    return [{"index": first_index + i, "id": new_call_id(), "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}}
            for i, call in enumerate(calls)]


def finish_reason(extracted: ExtractedToolCalls, engine_reason: str | None) -> str | None:
    """ "tool_calls" when the choice ended normally with calls; "length" (a cut-off call) stays as it is."""
    if extracted.tool_calls and engine_reason == "stop":
        return "tool_calls"
    return engine_reason
