"""Speculative decoding's configuration, in vLLM's `speculative_config` shape (torch-free).

`LLM(..., speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
"prompt_lookup_min": 2})` or `--speculative-config '<json>'`. The dict is validated here into a frozen
`SpeculativeConfig` before any process starts; what is not built is refused with the values that ask for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

METHODS = ("ngram",)
"""Drafting methods that are built: prompt lookup (cpllm/engine/ngram_drafter.py)."""
NOT_BUILT = ("draft_model", "eagle", "eagle3", "medusa", "mlp_speculator", "mtp", "suffix")
"""vLLM's other methods: refused by name."""
MAX_SPECULATIVE_TOKENS = 16
"""Most drafts a request may carry into one verify step (each is one more row of the step)."""
MAX_LOOKUP = 32
"""Longest n-gram prompt lookup may match."""
DEFAULT_LOOKUP = 5
"""prompt_lookup_min and _max when neither is given (one given: the other takes its value), as in vLLM."""
KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model")
"""The keys a speculative_config may have."""


@dataclass(kw_only=True, frozen=True, slots=True)
class SpeculativeConfig:
    """How requests are drafted and verified; None in EngineConfig means no speculation."""

    method: str
    """"ngram": prompt lookup over the request's prompt and output so far."""
    num_speculative_tokens: int
    """Most tokens drafted per request and step (k); a verify step scores k + 1 rows per request."""
    prompt_lookup_min: int = DEFAULT_LOOKUP
    """Shortest suffix of the tokens so far that prompt lookup matches earlier in them."""
    prompt_lookup_max: int = DEFAULT_LOOKUP
    """Longest such suffix; longer matches are tried first."""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method={self.method!r} is not built; built: {METHODS}")
        k = self.num_speculative_tokens
        if not _is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config num_speculative_tokens={k!r} must be an int in "
                             f"[1, {MAX_SPECULATIVE_TOKENS}]")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not _is_int(value) or not 1 <= value <= MAX_LOOKUP:
                raise ValueError(f"speculative_config {name}={value!r} must be an int in [1, {MAX_LOOKUP}]")
        if lo > hi:
            raise ValueError(f"speculative_config prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}")

    def describe(self) -> str:
        """One line for the start-up log: what drafts and how."""
        return (f"prompt lookup (n-gram {self.prompt_lookup_max} down to {self.prompt_lookup_min} over prompt + "
                f"output, most recent match), up to {self.num_speculative_tokens} drafts per request and step, "
                "verified in one step of k + 1 rows (greedy: argmax; sampled: rejection sampling)")


def speculative_config(value: Mapping[str, Any] | SpeculativeConfig | None, vocab_size: int,
                       draft_vocab: Callable[[str], int] | None = None) -> SpeculativeConfig | None:
    """The validated config of a `speculative_config` dict (None: no speculation). `vocab_size` is the target
    model's; `draft_vocab(path)` reads a draft model's vocabulary size (only called when a draft model is named)."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if not isinstance(value, Mapping):
        raise ValueError(f"speculative_config must be a dict (or JSON object), got {type(value).__name__}: "
                         f"{value!r}")
    unknown = sorted(set(value) - set(KEYS))
    if unknown:
        raise ValueError(f"speculative_config has unknown keys {unknown}; known: {list(KEYS)}")
    method = value.get("method") or ("draft_model" if value.get("model") else None)
    if method is None:
        raise ValueError("speculative_config needs a method (\"ngram\") or a draft model")
    if "num_speculative_tokens" not in value:
        raise ValueError("speculative_config needs num_speculative_tokens (the drafts per request and step)")
    if value.get("model") is not None or method in NOT_BUILT:
        _refuse_draft(value, method, vocab_size, draft_vocab)
    lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
    lo, hi = (DEFAULT_LOOKUP, DEFAULT_LOOKUP) if lo is None and hi is None else (lo if lo is not None else hi,
                                                                                  hi if hi is not None else lo)
    return SpeculativeConfig(method=method, num_speculative_tokens=value["num_speculative_tokens"],
                             prompt_lookup_min=lo, prompt_lookup_max=hi)


def _refuse_draft(value: Mapping[str, Any], method: str, vocab_size: int,
                  draft_vocab: Callable[[str], int] | None) -> None:
    """Every method but prompt lookup is refused; a draft model is first checked against the target's
    vocabulary, so the message says the more basic problem."""
    model = value.get("model")
    if model is not None and draft_vocab is not None:
        draft = draft_vocab(model)
        if draft != vocab_size:
            raise ValueError(f"speculative_config model={model!r} has a vocabulary of {draft} tokens; the target "
                             f"model's has {vocab_size}: a draft model must share the target's tokenizer")
    what = f"a draft model ({model!r})" if model is not None else f"method={method!r}"
    raise ValueError(f"speculative_config with {what} is not built; use {{\"method\": \"ngram\", ...}} "
                     "(prompt lookup)")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
