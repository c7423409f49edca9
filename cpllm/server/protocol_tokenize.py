"""Request bodies of vLLM's /tokenize and /detokenize, as pydantic models."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

from cpllm.server.errors import FieldError
from cpllm.server.protocol import TokenIds
from cpllm.server.request_fields import normalise_body


class TokenizeRequest(BaseModel):
    """POST /tokenize: a prompt (vLLM's completion form) or chat messages (its chat form), never both."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    """Served model name; None means the one model this server has."""
    prompt: str | None = None
    """Text to tokenize (completion form)."""
    messages: list[dict[str, Any]] | None = None
    """Chat messages to render with the chat template and tokenize (chat form; checked as chat messages)."""
    add_special_tokens: bool | None = None
    """Add the tokenizer's special tokens (BOS); None = true for a prompt, false for messages (the template
    writes its own), as vLLM."""
    add_generation_prompt: bool | None = None
    """Chat form: open the assistant's turn at the end; None = true."""
    continue_final_message: bool | None = None
    """Chat form: leave the last (assistant) message open, to be continued."""
    chat_template: str | None = None
    """Chat form: a template to use instead of the model's."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Chat form: extra variables for the template (e.g. enable_thinking)."""
    tools: list[dict[str, Any]] | None = None
    """Chat form: tools the template sees."""
    return_token_strs: bool | None = None
    """Also return each token's string (the tokenizer's token, not decoded text)."""

    @model_validator(mode="before")
    @classmethod
    def _normalise(cls, data: Any) -> Any:
        """Explicit nulls mean the default; unknown fields are ignored with one warning naming them."""
        return normalise_body(data, set(cls.model_fields))

    @model_validator(mode="after")
    def _one_form(self):
        if (self.prompt is None) == (self.messages is None):
            raise FieldError("give exactly one of prompt (text) or messages (chat)",
                             "messages" if self.messages is not None else "prompt")
        return self

    def chat_fields(self) -> dict[str, Any]:
        """The chat completion request fields that render the same prompt."""
        names = ("messages", "add_generation_prompt", "continue_final_message", "chat_template",
                 "chat_template_kwargs", "tools", "add_special_tokens")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}


class DetokenizeRequest(BaseModel):
    """POST /detokenize: token ids back to text."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    """Served model name; None means the one model this server has."""
    tokens: TokenIds
    """The ids to decode; each must be in the vocabulary."""

    @model_validator(mode="before")
    @classmethod
    def _normalise(cls, data: Any) -> Any:
        """Explicit nulls mean the default; unknown fields are ignored with one warning naming them."""
        return normalise_body(data, set(cls.model_fields))
