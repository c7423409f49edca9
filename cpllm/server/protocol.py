"""Request bodies of the OpenAI API (and vLLM's extra sampling fields), as pydantic models.

Types and shapes are checked here; value ranges are checked once, by SamplingParams,
whose ValueError names the field. Unknown fields are ignored, as OpenAI-compatible
servers do, so that newer clients keep working.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

TokenIds = list[Annotated[int, Field(ge=0)]]


class StreamOptions(BaseModel):
    include_usage: bool = False
    """Send one more chunk, with no choices, that carries the usage of the whole request."""


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
    """Accepted only when empty: the engine has no logit bias."""
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
        if self.logit_bias:
            raise ValueError("logit_bias is not supported by this server")
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

    @model_validator(mode="after")
    def _check_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return self

    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]
