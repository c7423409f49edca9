"""Request body of POST /v1/responses (OpenAI's Responses API), as pydantic models.

Only the shapes are checked here. What the request asks for is turned into a chat completion request by
responses_input.py; fields this server knows but cannot honour are refused there, by name.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from cpllm.server.request_fields import normalise_body


class ResponsesToolChoiceFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    """"function" forces the named function; other kinds (built-in tools, allowed_tools) are refused."""
    name: str | None = None
    """The function to call."""


class ResponsesTextFormat(BaseModel):
    """text.format: plain text, any JSON object, or JSON following a schema (flat: name and schema beside type)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"] = "text"
    """What the output must be."""
    name: str | None = None
    """The schema's name (json_schema)."""
    description: str | None = None
    """Accepted; not shown to the model."""
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    """The schema (named `schema` on the wire), required for json_schema."""
    strict: bool | None = None
    """Accepted; the output always follows the schema."""


class ResponsesText(BaseModel):
    model_config = ConfigDict(extra="ignore")

    format: ResponsesTextFormat | None = None
    """The output's format; None = plain text."""
    verbosity: str | None = None
    """Accepted and ignored (a hint for OpenAI's reasoning models)."""


class ResponsesRequest(BaseModel):
    """POST /v1/responses. Unknown fields are ignored, as on the other routes."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    """Served model name; None means the one model this server has."""
    input: str | list[dict[str, Any]]
    """A user message, or a list of items: messages, function_call and function_call_output (checked one by
    one, so that an error names its item)."""
    instructions: str | None = None
    """A system message put in front of the input."""
    max_output_tokens: int | None = None
    """Limit on generated tokens; None = up to max_model_len."""
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    """OpenAI's range [0, 2]; None = 1.0."""
    top_p: float | None = None
    """Nucleus sampling; None = 1.0."""
    tools: list[dict[str, Any]] | None = None
    """Tools, flat as the Responses API writes them ({"type": "function", "name", "parameters", ...}); only
    function tools are served, built-in ones (web_search, file_search, ...) are refused. Checked one by one."""
    tool_choice: Literal["none", "auto", "required"] | ResponsesToolChoiceFunction | None = None
    """None = "auto" when tools are given (parsed with --enable-auto-tool-choice), else "none"."""
    parallel_tool_calls: bool | None = None
    """False: at most one call when the call is forced ("required"); None = true."""
    text: ResponsesText | None = None
    """text.format constrains the output (structured outputs)."""
    stream: bool | None = None
    """Server-sent events, one per step of the response (created, deltas, done, completed)."""
    store: bool | None = None
    """Accepted; nothing is stored, so a later previous_response_id cannot refer to this response."""
    metadata: dict[str, str] | None = None
    """Echoed back in the response."""
    user: str | None = None
    """Accepted and ignored."""
    seed: int | None = None
    """vLLM's extra: the sampling seed."""
    # Known fields this server cannot honour: refused with a 400 naming them when given (see responses_input.py).
    previous_response_id: str | None = None
    """Needs stored responses, which this server does not keep."""
    conversation: Any = None
    """Needs stored conversations."""
    background: bool | None = None
    """Needs stored responses to poll."""
    prompt: Any = None
    """Stored prompt templates."""
    reasoning: Any = None
    """Reasoning settings (effort, summaries): no reasoning parser here."""
    include: list[str] | None = None
    """Extra output data (logprobs, encrypted reasoning, ...): none is produced."""
    top_logprobs: int | None = None
    """Logprobs in the Responses shape are not produced."""
    max_tool_calls: int | None = None
    """A bound on built-in tool calls."""
    truncation: Literal["auto", "disabled"] | None = None
    """Only "disabled" (OpenAI's default): a prompt that does not fit is a 400, never cut."""

    @model_validator(mode="before")
    @classmethod
    def _normalise(cls, data: Any) -> Any:
        """Explicit nulls mean the default; unknown fields are ignored with one warning naming them."""
        return normalise_body(data, set(cls.model_fields))


# ---- input items (validated one by one by responses_input.py, so that errors name the item) ----------------


class InputTextPart(BaseModel):
    """Text in a message: input_text (user, system, developer) or output_text (an earlier assistant reply)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["input_text", "output_text", "text"]
    """The part's kind; images, files and audio are not served."""
    text: str
    """The text."""


class MessageItem(BaseModel):
    """A message of the conversation ("type": "message", or no type with a role)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["message"] = "message"
    """Always "message"."""
    role: Literal["user", "assistant", "system", "developer"]
    """Who wrote it."""
    content: str | list[InputTextPart]
    """Its text, whole or in parts."""

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(BaseModel):
    """A call the model made earlier (an output item of a previous response, sent back)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function_call"]
    """Always "function_call"."""
    call_id: str
    """The id that the function_call_output answering it names."""
    name: str
    """The function called."""
    arguments: str
    """Its arguments, as JSON text."""


class FunctionCallOutputItem(BaseModel):
    """What a function returned, for the call `call_id`."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function_call_output"]
    """Always "function_call_output"."""
    call_id: str
    """The call this answers."""
    output: str | list[InputTextPart]
    """The function's result, as text."""

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)
