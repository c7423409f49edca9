"""Tool calling in chat requests: `tools`, `tool_choice`, and the messages that carry calls and results."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, field_validator

_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
"""OpenAI's rule for function names."""


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """JSON schema of the arguments; None = no arguments (an empty object)."""
    strict: bool | None = None
    """Accepted; forced calls always follow the schema, parsed "auto" calls are checked to be JSON."""

    @field_validator("name")
    @classmethod
    def _check_name(cls, name: str) -> str:
        if not _FUNCTION_NAME.match(name):
            raise ValueError(f"function name {name!r} must be 1-64 characters of a-z, A-Z, 0-9, _, ., -")
        return name


class ChatTool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    arguments: str = "{}"
    """JSON text, as OpenAI sends it back."""


class ToolCallMessagePart(BaseModel):
    """A tool call an assistant message made earlier in the conversation."""

    model_config = ConfigDict(extra="ignore")

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


def tool_schemas(tools: list[ChatTool]) -> list[dict[str, Any]]:
    """The tools as chat templates expect them (transformers' `tools=` argument)."""
    return [{"type": "function", "function": t.function.model_dump(exclude_none=True)} for t in tools]


def parameters_schema(function: FunctionDefinition) -> dict[str, Any]:
    """The function's argument schema; a function without one takes an empty object."""
    return function.parameters if function.parameters is not None else {"type": "object", "properties": {}}


__all__ = ["ChatTool", "FunctionDefinition", "NamedToolChoice", "ToolChoice", "ToolCallMessagePart",
           "tool_schemas", "parameters_schema"]
