"""Request bodies of the OpenAI API (and vLLM's extra sampling fields), as pydantic models.

Types and shapes are checked here; value ranges are checked once, by SamplingParams,
whose ValueError names the field. Unknown fields are ignored, as OpenAI-compatible
servers do, so that newer clients keep working.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from cpllm.server.protocol_tools import ChatTool, ToolCallMessagePart, ToolChoice

TokenIds = list[Annotated[int, Field(ge=0)]]


class StreamOptions(BaseModel):
    include_usage: bool = False
    """Send one more chunk, with no choices, that carries the usage of the whole request."""


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    """The schema (named `schema` on the wire); None = any JSON object."""
    strict: bool | None = None
    """Accepted; the output always follows the schema."""


class ResponseFormat(BaseModel):
    """OpenAI's response_format."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check_schema(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('response_format of type "json_schema" needs a json_schema field')
        return self


class StructuredOutputsFields(BaseModel):
    """vLLM's `structured_outputs` request field (the same names as its StructuredOutputsParams)."""

    model_config = ConfigDict(extra="ignore")

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None
    disable_additional_properties: bool = False


class SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    """Served model name; None means the one model this server has."""
    n: int = 1
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    """OpenAI's range [0, 2]; None = 1.0."""
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    """Accepted and ignored."""
    logit_bias: dict[str, float] | None = None
    """Token id (as a string) -> bias added to its logit, in [-100, 100]."""
    best_of: int | None = None
    """Accepted when equal to n (or 1 with n=1); larger values are refused: the engine does not rank samples."""
    response_format: ResponseFormat | None = None
    """{"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema": ...}} constrain the output."""
    # vLLM's structured-output fields: the newer object and the older guided_* fields
    structured_outputs: StructuredOutputsFields | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None
    """Accepted and ignored: llguidance is the one backend."""
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: TokenIds | None = None
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    @model_validator(mode="after")
    def _check_common(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed together with stream=true")
        return self


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    """Text, token ids, or a batch of either; each prompt gets n choices."""
    max_tokens: int | None = 16
    logprobs: int | None = None
    """Logprobs of the sampled token plus this many alternatives (0..20)."""
    echo: bool = False
    """Put the prompt in front of each choice's text (and its logprobs first)."""

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts, each text or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        if not prompt:
            raise ValueError("prompt is empty")
        return list(prompt)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessagePart] | None = None
    """Calls an assistant message made (passed to the chat template)."""
    tool_call_id: str | None = None
    """The call a tool message answers."""

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = None
    """Deprecated by OpenAI in favour of max_completion_tokens; None = up to max_model_len."""
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    """Alternatives per position (0..20); needs logprobs=true."""
    add_generation_prompt: bool = True
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None
    """None = "auto" when tools are given (parsed only with --enable-auto-tool-choice), else "none"."""
    parallel_tool_calls: bool = True
    """False: at most one call when tool_choice is "required"."""

    @model_validator(mode="after")
    def _check_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return self

    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict[str, Any]]:
        return [_template_message(m) for m in self.messages]


def _template_message(message: ChatMessage) -> dict[str, Any]:
    """One message as chat templates read it; tool-call arguments as objects, as most templates expect."""
    out: dict[str, Any] = {"role": message.role, "content": message.text()}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        out["tool_calls"] = [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": _arguments_object(call.function.arguments)}}
            for call in message.tool_calls
        ]
    return out


def _arguments_object(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments
