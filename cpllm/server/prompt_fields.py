"""vLLM's prompt and token fields, shared by both endpoints: truncate_prompt_tokens, bad_words, allowed_token_ids,
return_tokens_as_token_ids and the `prompt_logprobs` / `token_ids` parts of a response."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

from cpllm.engine.outputs import PositionLogprobs, RequestOutput
from cpllm.model.tokenization.tokenizer import Tokenizer
from cpllm.server.errors import bad_request
from cpllm.server.formatting import TokenTexts, clamp
from cpllm.server.protocol import ChatCompletionRequest, SamplingFields

if TYPE_CHECKING:
    from cpllm.server.requests import ServerContext

R = TypeVar("R", bound=SamplingFields)


class TokenIdTexts:
    """Tokens spelled "token_id:N" (return_tokens_as_token_ids), with TokenTexts' interface."""

    @staticmethod
    def text(token_id: int) -> str:
        return f"token_id:{token_id}"


def echo_prefix(req: ChatCompletionRequest) -> str:
    """vLLM's chat echo: the last message's text when it is the assistant's (the reply continues it), else ""."""
    if not req.echo or not req.messages:
        return ""
    last = req.messages[-1]
    return last.text() if last.role == "assistant" else ""


def token_texts(texts: TokenTexts, req: SamplingFields) -> TokenTexts | TokenIdTexts:
    """How this request's logprobs spell tokens."""
    return TokenIdTexts() if req.return_tokens_as_token_ids else texts


def truncated(token_ids: list[int], req: SamplingFields, max_model_len: int) -> list[int]:
    """The prompt cut to truncate_prompt_tokens ids (-1: max_model_len): its last ones, or its first ones with
    truncation_side "right"; all of it when the field is unset."""
    keep = req.truncate_prompt_tokens
    if keep is None:
        return token_ids
    if keep == -1:
        keep = max_model_len
    if keep > max_model_len:
        raise bad_request(f"truncate_prompt_tokens={keep} exceeds max_model_len={max_model_len}",
                          "truncate_prompt_tokens")
    return token_ids[:keep] if req.truncation_side == "right" else token_ids[-keep:]


def check_allowed_token_ids(req: SamplingFields, vocab_size: int) -> None:
    """allowed_token_ids, logprob_token_ids and stop_token_ids inside the vocabulary (every bad id named)."""
    for name in ("allowed_token_ids", "logprob_token_ids", "stop_token_ids"):
        check_token_ids(getattr(req, name) or (), vocab_size, name)


def check_token_ids(token_ids, vocab_size: int, name: str) -> None:
    """400 naming every id of `token_ids` out of the vocabulary [0, vocab_size), and the field."""
    bad = [t for t in token_ids if t >= vocab_size]
    if bad:
        raise bad_request(f"{name}: token id(s) {', '.join(map(str, bad))} out of vocabulary (the ids are 0 to "
                          f"{vocab_size - 1})", name)


def logprobs_limit(max_logprobs: int, vocab_size: int) -> int:
    """The most logprobs a request may ask for: --max-logprobs, or the whole vocabulary when it is -1."""
    return vocab_size if max_logprobs == -1 else max_logprobs


def resolve_logprobs(value: int | None, name: str, max_logprobs: int, vocab_size: int) -> int | None:
    """A logprobs count as the engine takes it: -1 means the whole vocabulary; above --max-logprobs is a 400."""
    if value is None:
        return None
    limit = logprobs_limit(max_logprobs, vocab_size)
    count = vocab_size if value == -1 else value
    if count > limit:
        asked = f"{name}=-1 asks for the whole vocabulary ({vocab_size} tokens), which" if value == -1 else \
            f"{name}={value}"
        raise bad_request(f"{asked} exceeds this server's limit of {limit} (--max-logprobs {max_logprobs}; "
                          "-1 allows the whole vocabulary)", name)
    return count


def resolved_counts(ctx: ServerContext, req: R, names: tuple[str, ...], *, wants_logprobs: bool) -> tuple[R, int]:
    """The request with its logprobs counts (`names`) as the engine takes them (-1: the vocabulary), and the bound
    the engine checks them against; logprob_token_ids without logprobs is a 400 (there would be nothing to report
    them in)."""
    vocab_size = ctx.engine.tokenizer.vocab_size
    max_logprobs = ctx.options.max_logprobs
    update = {name: resolve_logprobs(getattr(req, name), name, max_logprobs, vocab_size) for name in names}
    if req.logprob_token_ids and not wants_logprobs:
        raise bad_request("logprob_token_ids needs logprobs (chat: logprobs=true); they are reported there",
                          "logprob_token_ids")
    return req.model_copy(update=update), logprobs_limit(max_logprobs, vocab_size)


def bad_words_token_ids(tokenizer: Tokenizer, words: list[str] | None) -> list[list[int]] | None:
    """Each word's tokenizations, alone and after a space (as it appears mid-text), as vLLM masks them."""
    if not words:
        return None
    out: list[list[int]] = []
    for word in words:
        if not word.strip():
            raise bad_request("bad_words entries must not be empty", "bad_words")
        for spelling in (word.strip(), " " + word.strip()):
            ids = tokenizer.encode(spelling, add_special_tokens=False)
            if ids and ids not in out:
                out.append(ids)
    return out


def prompt_logprobs_json(texts: TokenTexts | TokenIdTexts, output: RequestOutput) -> list[dict | None] | None:
    """vLLM's `prompt_logprobs`: per prompt position None (the first) or {token id: {logprob, rank, decoded_token}}."""
    positions: list[PositionLogprobs | None] | None = output.prompt_logprobs
    if positions is None:
        return None
    return [None if position is None else
            {str(tok): {"logprob": clamp(lp.logprob), "rank": lp.rank, "decoded_token": texts.text(tok)}
             for tok, lp in position.items()}
            for position in positions]
