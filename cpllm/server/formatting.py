"""Pieces of OpenAI responses shared by both endpoints: sampling params, stream deltas, logprobs, usage."""

from __future__ import annotations

import dataclasses
import functools
import json
import math

from cpllm.engine.outputs import PositionLogprobs, RequestOutput
from cpllm.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from cpllm.model.tokenization.tokenizer import Tokenizer
from cpllm.server.errors import bad_request, param_of
from cpllm.server.protocol import SamplingFields
from cpllm.structured.params import StructuredOutputsParams

SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams)) | {"prompt", "max_completion_tokens"}
DEFAULT_MAX_N = 16
"""Largest n when the caller gives no limit (the server passes --max-n)."""
LOGPROB_FLOOR = -9999.0
"""JSON has no -inf; a token the model cannot produce gets this logprob instead."""


def sampling_params(req: SamplingFields, *, max_tokens: int | None, logprobs: int | None,
                    prompt_logprobs: int | None = None, max_tokens_param: str = "max_tokens",
                    structured: StructuredOutputsParams | None = None, max_n: int = DEFAULT_MAX_N,
                    bad_words_token_ids: list[list[int]] | None = None,
                    max_logprobs: int = MAX_LOGPROBS) -> SamplingParams:
    """The request's SamplingParams; a bad value becomes a 400 that names the field. `max_logprobs` is the
    server's bound on logprobs counts (already resolved to the vocabulary size when that is allowed)."""
    _check_n(req, max_n)
    given = {
        "n": req.n, "temperature": req.temperature, "top_p": req.top_p, "seed": req.seed, "stop": req.stop,
        "presence_penalty": req.presence_penalty, "frequency_penalty": req.frequency_penalty, "top_k": req.top_k,
        "min_p": req.min_p, "repetition_penalty": req.repetition_penalty, "stop_token_ids": req.stop_token_ids,
    }
    try:
        return SamplingParams(
            **{k: v for k, v in given.items() if v is not None},
            max_tokens=max_tokens, ignore_eos=req.ignore_eos, min_tokens=req.min_tokens,
            skip_special_tokens=req.skip_special_tokens, include_stop_str_in_output=req.include_stop_str_in_output,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs, logit_bias=_logit_bias(req),
            structured_outputs=structured, allowed_token_ids=getattr(req, "allowed_token_ids", None),
            bad_words_token_ids=bad_words_token_ids, max_logprobs=max_logprobs,
            logprob_token_ids=getattr(req, "logprob_token_ids", None),
            extra_args={"kv_transfer_params": req.kv_transfer_params} if req.kv_transfer_params else None,
        )
    except ValueError as exc:
        message = str(exc)
        param = param_of(message, SAMPLING_FIELDS)
        if param == "max_tokens":
            param, message = max_tokens_param, message.replace("max_tokens", max_tokens_param, 1)
        raise bad_request(message, param) from exc


def kv_transfer_answer(outputs) -> dict:
    """`{"kv_transfer_params": ...}` of a prefill instance's finished request (vLLM's top-level response field,
    which its proxy hands the decode instance); {} when no output carries one."""
    params = [out.kv_transfer_params for out in outputs if getattr(out, "kv_transfer_params", None) is not None]
    return {"kv_transfer_params": params[0]} if params else {}


def _check_n(req: SamplingFields, max_n: int) -> None:
    if isinstance(req.n, int) and req.n > max_n:
        raise bad_request(f"n={req.n} exceeds this server's limit of {max_n} choices per request (--max-n)", "n")
    if req.best_of is not None and req.best_of != req.n:
        # Silently returning n of best_of samples unranked would be wrong; ranking them is not implemented.
        raise bad_request(f"best_of={req.best_of} is not supported: it must be left out or equal n={req.n}",
                          "best_of")


def _logit_bias(req: SamplingFields) -> dict[int, float] | None:
    """OpenAI sends token ids as JSON object keys (strings)."""
    if not req.logit_bias:
        return None
    bad = [key for key in req.logit_bias if not key.strip().isdigit()]
    if bad:  # every bad key named at once, so one fix is enough
        raise bad_request(f"logit_bias keys must be token ids, got {', '.join(map(repr, bad))}", "logit_bias")
    return {int(key): bias for key, bias in req.logit_bias.items()}


def engine_error(exc: ValueError, max_tokens_param: str = "max_tokens"):
    """A ValueError of LLMEngine.add_request (prompt too long, bad token id) as a 400."""
    message = str(exc)
    param = param_of(message, SAMPLING_FIELDS)
    if message.startswith("invalid ") and " constraint: " in message:  # the grammar engine refused it
        param = "response_format"
    if "max_model_len" in message:
        param = "max_tokens" if "max_tokens=" in message else "prompt"
        if param == "max_tokens":
            param = max_tokens_param
    return bad_request(message, param or "prompt")


def pending_stop_prefix(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    best = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:size]):
                best = size
                break
    return best


@dataclasses.dataclass(slots=True)
class ChoiceCursor:
    """What one streamed choice has sent so far."""

    chars: int = 0
    tokens: int = 0
    done: bool = False

    def advance(self, text: str, finished: bool, params: SamplingParams) -> str:
        """New text to stream: all of it once finished, else minus a tail that a stop string may still cut."""
        end = len(text)
        if not finished and not params.include_stop_str_in_output:
            end -= pending_stop_prefix(text, params.stop)
        end = max(end, self.chars)
        delta = text[self.chars : end]
        self.chars = end
        return delta


class TokenTexts:
    """Text of single tokens, for logprobs (cached: the same ids come back all the time)."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self.text = functools.lru_cache(maxsize=65536)(self._decode)

    def _decode(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False)


def clamp(logprob: float) -> float:
    return LOGPROB_FLOOR if math.isinf(logprob) or math.isnan(logprob) else max(logprob, LOGPROB_FLOOR)


def top_entries(position: PositionLogprobs, num_top: int, named: list[int] | None = None,
                sampled: int | None = None) -> list[tuple[int, float]]:
    """The position's alternatives ranked 1..num_top, best first; or, when the request named its tokens
    (logprob_token_ids), the sampled token and then those tokens in the order named (each once), as vLLM's
    sampler gathers them (sampled first) and its chat route lists them all, whatever top_logprobs says."""
    if named:
        first = [sampled] if sampled is not None else []
        return [(tok, position[tok].logprob) for tok in dict.fromkeys([*first, *named]) if tok in position]
    ranked = sorted(((lp.rank or 0, tok, lp.logprob) for tok, lp in position.items() if (lp.rank or 0) <= num_top))
    seen, out = set(), []
    for _, tok, lp in ranked:
        if tok not in seen:
            seen.add(tok)
            out.append((tok, lp))
    return out[:num_top]


def completion_logprobs(texts: TokenTexts, token_ids: list[int], positions: list[PositionLogprobs | None],
                        num_top: int, offset: int, named: list[int] | None = None) -> dict:
    """OpenAI completions shape: tokens, token_logprobs, top_logprobs, text_offset (from `offset` on)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, position in zip(token_ids, positions):
        token = texts.text(token_id)
        out["tokens"].append(token)
        out["text_offset"].append(offset)
        offset += len(token)
        if position is None:  # the first prompt token has no logprob
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(clamp(position[token_id].logprob))
        top = {texts.text(tok): clamp(lp) for tok, lp in top_entries(position, num_top, named, token_id)}
        top.setdefault(token, clamp(position[token_id].logprob))
        out["top_logprobs"].append(top)
    return out


def chat_logprobs(texts: TokenTexts, token_ids: list[int], positions: list[PositionLogprobs], num_top: int,
                  named: list[int] | None = None) -> dict:
    """OpenAI chat shape: {"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}."""
    def entry(token_id: int, logprob: float) -> dict:
        token = texts.text(token_id)
        return {"token": token, "logprob": clamp(logprob), "bytes": list(token.encode("utf-8"))}

    content = []
    for token_id, position in zip(token_ids, positions):
        item = entry(token_id, position[token_id].logprob)
        item["top_logprobs"] = [entry(tok, lp) for tok, lp in top_entries(position, num_top, named, token_id)]
        content.append(item)
    return {"content": content}


def usage(outputs: list[RequestOutput], details: bool = False, prompt_tokens: int | None = None) -> dict:
    """prompt_tokens per prompt (once, not per choice) and every generated token of every choice so far;
    `cache_read_input_tokens` the prompt tokens read from the prefix cache, repeated in
    `prompt_tokens_details.cached_tokens` when `details` (--enable-prompt-tokens-details; else that is null, as
    in vLLM). `prompt_tokens` overrides the count when some prompt has no output yet (a stream's first chunks)."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs) if prompt_tokens is None else prompt_tokens
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached} if details else None,
            "cache_read_input_tokens": cached}


def sse(payload: dict | str) -> str:
    """One server-sent event."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    return f"data: {data}\n\n"
