"""Request bodies of the OpenAI API (and vLLM's extra sampling fields), as pydantic models.

Types and shapes are checked here; value ranges are checked once, by SamplingParams,
whose ValueError names the field. An explicit null means the field's default. Unknown
fields are ignored with a warning, as vLLM does, so that newer clients keep working;
vLLM fields this server cannot honour are refused (request_fields.REFUSED).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from cpllm.server.errors import FieldError
from cpllm.server.protocol_tools import ChatTool, ToolCallMessagePart, ToolChoice
from cpllm.server.request_fields import normalise_body

TokenIds = list[Annotated[int, Field(ge=0)]]


class StreamOptions(BaseModel):
    include_usage: bool = False
    """Send one more chunk, with no choices, that carries the usage of the whole request."""
    continuous_usage_stats: bool = False
    """With include_usage: every chunk also carries the usage so far."""


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    """The schema (named `schema` on the wire); required, as OpenAI requires it."""
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
    seed: Annotated[int, Field(ge=-(2**63), le=2**63 - 1)] | None = None
    """A 64-bit signed integer, as vLLM takes it."""
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
    spaces_between_special_tokens: bool = True
    """Accepted: fast tokenizers (all this server loads, as in vLLM) never put spaces between special tokens."""
    allowed_token_ids: TokenIds | None = None
    """Only these token ids may be sampled."""
    bad_words: list[str] | None = None
    """Words the output may not contain (their tokenizations, with and without a leading space, are masked)."""
    prompt_logprobs: Annotated[int, Field(ge=-1)] | None = None
    """Logprobs of every prompt token plus this many alternatives, in the response's `prompt_logprobs`; -1 = the
    whole vocabulary. Bounded by --max-logprobs (checked by the route)."""
    logprob_token_ids: TokenIds | None = None
    """Report these tokens' logprobs at every generated position instead of the top alternatives."""
    kv_transfer_params: dict[str, Any] | None = None
    """Disaggregated prefill/decode, in vLLM's proxy's keys (docs/disaggregated.md): `do_remote_decode` on the
    prefill instance, the prefill answer's `do_remote_prefill`, `remote_block_ids`, ... on the decode instance;
    the engine needs --kv-transfer-config."""
    return_tokens_as_token_ids: bool = False
    """Spell logprobs' tokens as "token_id:N" (tokens that are not valid UTF-8 alone stay distinguishable)."""
    return_token_ids: bool = False
    """Put the prompt's and each choice's token ids in the response (`prompt_token_ids`, `token_ids`)."""
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    """Keep only k prompt tokens (the last ones unless truncation_side says "right"); -1 = max_model_len."""
    truncation_side: Literal["left", "right"] | None = None
    """Which end truncate_prompt_tokens cuts: "left" (the default) drops the first tokens, "right" the last."""
    request_id: str | None = None
    """The id the response carries (after its "cmpl-"/"chatcmpl-" prefix); None = a random one."""
    echo: bool = False
    use_beam_search: bool = False
    """Search n beams instead of sampling (cpllm/server/beam_search.py); n >= 2."""
    length_penalty: float = 1.0
    """Beam search: beams are ranked by cumulative logprob / length ** length_penalty."""

    @model_validator(mode="before")
    @classmethod
    def _normalise(cls, data: Any) -> Any:
        return normalise_body(data, set(cls.model_fields))

    @model_validator(mode="after")
    def _check_common(self):
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options is only allowed together with stream=true", "stream_options")
        if self.logprob_token_ids == []:
            raise FieldError("logprob_token_ids must not be an empty list", "logprob_token_ids")
        if self.length_penalty != 1.0 and not self.use_beam_search:
            raise FieldError("length_penalty only applies with use_beam_search=true", "length_penalty")
        if self.truncate_prompt_tokens == 0:
            raise FieldError("truncate_prompt_tokens must be >= 1 (or -1 for max_model_len)", "truncate_prompt_tokens")
        if self.stream and self.prompt_logprobs is not None:
            raise FieldError("prompt_logprobs is not supported with stream=true", "prompt_logprobs")
        return self


NO_PROMPT = ("Either prompt or prompt_embeds must be provided and non-empty (this server takes no prompt_embeds: "
             "give prompt, text or token ids)")
"""vLLM's sentence for a completion without a prompt, which its clients match, then what this server takes."""


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    """Text, token ids, or a batch of either; each prompt gets n choices."""

    @model_validator(mode="before")
    @classmethod
    def _require_prompt(cls, data: Any) -> Any:
        # Before field validation, so a missing or null prompt gets vLLM's message rather than pydantic's "Field
        # required"; embeddings that are there are left for normalise_body to refuse by name.
        if isinstance(data, dict) and data.get("prompt") is None and data.get("prompt_embeds") in (None, [], "", {}):
            raise FieldError(NO_PROMPT, "prompt")
        return data
    max_tokens: int | None = 16
    logprobs: Annotated[int, Field(ge=-1)] | None = None
    """Logprobs of the sampled token plus this many alternatives (up to --max-logprobs; -1 = the vocabulary)."""
    add_special_tokens: bool = True
    """Add the tokenizer's special tokens (BOS) to a text prompt."""

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts, each text or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        if not prompt:
            raise ValueError(f"prompt is empty. {NO_PROMPT}")
        return list(prompt)


def _text_part_schema(schema: dict[str, Any]) -> None:
    # The published schema says what is served: text parts (others are parsed only to be refused by name).
    schema["properties"] = {"type": {"const": "text"}, "text": {"type": "string"}}
    schema["required"] = ["type", "text"]


def _message_schema(schema: dict[str, Any]) -> None:
    # OpenAI's per-role rules (checked by _check_message), stated in the schema so generators and clients see them.
    has_content = {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}}
    schema["allOf"] = [
        {"if": {"properties": {"role": {"enum": ["system", "developer", "user", "tool"]}}}, "then": has_content},
        {"if": {"properties": {"role": {"const": "tool"}}},
         "then": {"required": ["tool_call_id"], "properties": {"tool_call_id": {"type": "string", "minLength": 1}}}},
        {"if": {"properties": {"role": {"const": "assistant"}}},
         "then": {"anyOf": [has_content, {"required": ["tool_calls"],
                                          "properties": {"tool_calls": {"type": "array", "minItems": 1}}}]}},
    ]


class ContentPart(BaseModel):
    """One part of a message's content; only text parts are supported (others are refused by the request)."""

    model_config = ConfigDict(extra="allow", json_schema_extra=_text_part_schema)

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", json_schema_extra=_message_schema)

    role: Annotated[str, Field(min_length=1, examples=["system", "developer", "user", "assistant", "tool"])]
    """OpenAI's five roles, or any other name (e.g. "my-custom-role"), which goes to the chat template as it is,
    as vLLM's custom-role messages do; OpenAI's per-role rules apply to its own roles."""
    content: str | list[ContentPart] | None = None
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
        return "".join(part.text or "" for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    """At least one, except with prompt_token_ids (then none)."""
    prompt_token_ids: TokenIds | None = None
    """vLLM's chat token-in: the rendered prompt's ids, sent with messages=[]; no template runs."""
    max_tokens: int | None = None
    """Deprecated by OpenAI in favour of max_completion_tokens; None = up to max_model_len."""
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=-1)] | None = None
    """Alternatives per position (up to --max-logprobs; -1 = the vocabulary); needs logprobs=true."""
    add_generation_prompt: bool = True
    """End the prompt with the template's opening of an assistant turn."""
    continue_final_message: bool = False
    """Render the last (assistant) message open-ended, so the model continues it instead of starting a new turn."""
    add_special_tokens: bool = False
    """Add the tokenizer's special tokens on top of the template's (vLLM's default: no, the template has them)."""
    chat_template: str | None = None
    """A Jinja template used instead of the model's."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra variables for the template (e.g. Qwen3's enable_thinking)."""
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None
    """None = "auto" when tools are given (parsed only with --enable-auto-tool-choice), else "none"."""
    parallel_tool_calls: bool = True
    """False: at most one call (the grammar allows one under "required", the first is kept under "auto")."""
    include_reasoning: bool = True
    """With --reasoning-parser: return the thinking in message.reasoning (false drops it)."""

    @model_validator(mode="after")
    def _check_chat(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("top_logprobs needs logprobs=true", "top_logprobs")
        if self.prompt_token_ids is not None:
            _check_token_in(self)
        elif not self.messages:
            raise FieldError("messages must hold at least one message (or send prompt_token_ids with "
                             "messages=[])", "messages")
        if self.continue_final_message:
            if "add_generation_prompt" in self.model_fields_set and self.add_generation_prompt:
                raise FieldError("continue_final_message and add_generation_prompt cannot both be true",
                                 "continue_final_message")
            if self.messages[-1].role != "assistant":
                raise FieldError("continue_final_message needs the last message to be the assistant's",
                                 "continue_final_message")
            self.add_generation_prompt = False
        for i, message in enumerate(self.messages):
            _check_message(message, f"messages.{i}")
        return self

    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict[str, Any]]:
        return [_template_message(m) for m in self.messages]


TEMPLATE_FIELDS = ("add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs",
                   "tools", "echo")
"""Chat fields that shape the rendered prompt, which a token-in request (prompt_token_ids) has already."""


def _check_token_in(req: ChatCompletionRequest) -> None:
    """Token-in: no messages and no template option, since no template runs."""
    if req.messages:
        raise FieldError("prompt_token_ids replaces messages: send messages=[] with it", "messages")
    for name in TEMPLATE_FIELDS:
        if name in req.model_fields_set and getattr(req, name) not in (None, False, []):
            raise FieldError(f"{name} is a chat-template option; prompt_token_ids is an already rendered prompt, "
                             "so it cannot be combined with it", name)


def _check_message(message: ChatMessage, where: str) -> None:
    """OpenAI's rules for one message: content where its role needs it, tool_call_id on tool results,
    text parts only."""
    if message.content is None and message.role != "assistant":
        raise FieldError(f"{where}.content: a {message.role} message needs content", f"{where}.content")
    if message.content is None and message.role == "assistant" and not message.tool_calls:
        raise FieldError(f"{where}.content: an assistant message needs content or tool_calls", f"{where}.content")
    if message.role == "tool" and not message.tool_call_id:
        raise FieldError(f"{where}.tool_call_id: a tool message needs the id of the call it answers",
                         f"{where}.tool_call_id")
    for j, part in enumerate(message.content if isinstance(message.content, list) else []):
        param = f"{where}.content.{j}"
        if part.type in ("image_url", "input_image", "image"):
            raise FieldError(f"{param}: image inputs are not supported by this server (a text-only model)", param)
        if part.type != "text":
            raise FieldError(f"{param}: content parts of type {part.type!r} are not supported; send text", param)
        if part.text is None:
            raise FieldError(f"{param}.text: a text part needs text", f"{param}.text")


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
