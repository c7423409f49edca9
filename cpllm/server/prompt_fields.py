"""vLLM's prompt and token fields, shared by both endpoints: truncate_prompt_tokens, bad_words, allowed_token_ids,
return_tokens_as_token_ids and the `prompt_logprobs` / `token_ids` parts of a response."""

from __future__ import annotations

from cpllm.engine.outputs import PositionLogprobs, RequestOutput
from cpllm.model.tokenizer import Tokenizer
from cpllm.server.errors import bad_request
from cpllm.server.formatting import TokenTexts, clamp
from cpllm.server.protocol import ChatCompletionRequest, SamplingFields


class TokenIdTexts:
    """Tokens spelled "token_id:N" (return_tokens_as_token_ids), with TokenTexts' interface."""

    @staticmethod
    def text(token_id: int) -> str:
        return f"token_id:{token_id}"


def echo_prefix(req: ChatCompletionRequest) -> str:
    """vLLM's chat echo: the last message's text when it is the assistant's (the reply continues it), else ""."""
    last = req.messages[-1]
    return last.text() if req.echo and last.role == "assistant" else ""


def token_texts(texts: TokenTexts, req: SamplingFields) -> TokenTexts | TokenIdTexts:
    """How this request's logprobs spell tokens."""
    return TokenIdTexts() if req.return_tokens_as_token_ids else texts


def truncated(token_ids: list[int], req: SamplingFields, max_model_len: int) -> list[int]:
    """The prompt's last truncate_prompt_tokens ids (-1: the last max_model_len); all of it when the field is unset."""
    keep = req.truncate_prompt_tokens
    if keep is None:
        return token_ids
    if keep == -1:
        keep = max_model_len
    if keep > max_model_len:
        raise bad_request(f"truncate_prompt_tokens={keep} exceeds max_model_len={max_model_len}",
                          "truncate_prompt_tokens")
    return token_ids[-keep:]


def check_allowed_token_ids(req: SamplingFields, vocab_size: int) -> None:
    bad = [t for t in req.allowed_token_ids or () if t >= vocab_size]
    if bad:
        raise bad_request(f"allowed_token_ids: token id {bad[0]} is outside the vocabulary [0, {vocab_size})",
                          "allowed_token_ids")


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
