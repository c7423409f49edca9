"""Speculative decoding's configuration, in vLLM's `speculative_config` shape (torch-free).

`LLM(..., speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
"prompt_lookup_min": 2})`, `{"model": "path/to/draft", "num_speculative_tokens": 4}` (a draft model: method
"draft_model") or `--speculative-config '<json>'`. The dict is validated here into a frozen `SpeculativeConfig`
before any process starts; what is not built is refused with the values that ask for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

METHODS = ("ngram", "draft_model")
"""Drafting methods that are built: prompt lookup (cpllm/engine/ngram_drafter.py) and a draft model
(cpllm/engine/draft_model.py)."""
NOT_BUILT = ("eagle", "eagle3", "medusa", "mlp_speculator", "mtp", "suffix")
"""vLLM's other methods: refused by name."""
MAX_SPECULATIVE_TOKENS = 16
"""Most drafts a request may carry into one verify step (each is one more row of the step)."""
MAX_LOOKUP = 32
"""Longest n-gram prompt lookup may match."""
DEFAULT_LOOKUP = 5
"""prompt_lookup_min and _max when neither is given (one given: the other takes its value), as in vLLM."""
DRAFT_LENGTHS = ("adaptive", "fixed")
"""`draft_length`: each request's own limit of at most k (cpllm/engine/draft_length.py), or always up to k."""
KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model",
        "draft_tensor_parallel_size", "draft_length")
"""The keys a speculative_config may have."""
LOOKUP_KEYS = ("prompt_lookup_max", "prompt_lookup_min")
"""Keys of prompt lookup only (refused with a draft model)."""


@dataclass(kw_only=True, frozen=True, slots=True)
class SpeculativeConfig:
    """How requests are drafted and verified; None in EngineConfig means no speculation."""

    method: str
    """"ngram": prompt lookup over the request's prompt and output so far; "draft_model": a smaller model of the
    same vocabulary, run on the replica's driver rank."""
    num_speculative_tokens: int
    """Most tokens drafted per request and step (k); a verify step scores k + 1 rows per request."""
    prompt_lookup_min: int = DEFAULT_LOOKUP
    """Shortest suffix of the tokens so far that prompt lookup matches earlier in them."""
    prompt_lookup_max: int = DEFAULT_LOOKUP
    """Longest such suffix; longer matches are tried first."""
    model: str | None = None
    """The draft model's folder or .gguf file (method "draft_model" only)."""
    draft_length: str = "adaptive"
    """"adaptive": each request drafts up to a limit of its own, halved down to the accepted run after a rejection
    and doubled back to k after a step that accepts every draft (cpllm/engine/draft_length.py); "fixed": always up
    to k (vLLM's behaviour). A cpllm key: vLLM has none."""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method={self.method!r} is not built; built: {METHODS}")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError(f"speculative_config method={self.method!r} with model={self.model!r}: a draft model "
                             "is named exactly when the method is 'draft_model'")
        k = self.num_speculative_tokens
        if not _is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config num_speculative_tokens={k!r} must be an int in "
                             f"[1, {MAX_SPECULATIVE_TOKENS}]")
        if self.draft_length not in DRAFT_LENGTHS:
            raise ValueError(f"speculative_config draft_length={self.draft_length!r}; choose one of {DRAFT_LENGTHS}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not _is_int(value) or not 1 <= value <= MAX_LOOKUP:
                raise ValueError(f"speculative_config {name}={value!r} must be an int in [1, {MAX_LOOKUP}]")
        if lo > hi:
            raise ValueError(f"speculative_config prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}")

    def describe(self) -> str:
        """One line for the start-up log: what drafts and how (a draft model's line is its drafter's, which knows
        its layout and KV pool: cpllm/engine/draft_model.py)."""
        if self.method == "draft_model":
            return (f"draft model {self.model}, up to {self.num_speculative_tokens} drafts per request and step "
                    f"({self.draft_length}), "
                    "verified in one step of k + 1 rows (greedy: argmax; sampled: rejection sampling against the "
                    "draft's distribution)")
        return (f"prompt lookup (n-gram {self.prompt_lookup_max} down to {self.prompt_lookup_min} over prompt + "
                f"output, most recent match), up to {self.num_speculative_tokens} drafts per request and step "
                f"({self.draft_length}), "
                "verified in one step of k + 1 rows (greedy: argmax; sampled: rejection sampling)")


def speculative_config(value: Mapping[str, Any] | SpeculativeConfig | None, vocab_size: int,
                       draft_vocab: Callable[[str], int] | None = None, *, max_model_len: int | None = None,
                       draft_positions: Callable[[str], int] | None = None) -> SpeculativeConfig | None:
    """The validated config of a `speculative_config` dict (None: no speculation). `vocab_size` is the target
    model's; `draft_vocab(path)` reads a draft model's vocabulary size and `draft_positions(path)` its context
    length, checked against `max_model_len` (each only called when a draft model is named)."""
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
    if method in NOT_BUILT or method not in METHODS:
        raise ValueError(f"speculative_config method={method!r} is not built; built: {METHODS} "
                         "(a draft model: {\"model\": \"path/to/draft\", ...})")
    if method == "draft_model" or value.get("model") is not None:
        return _draft_model_config(value, method, vocab_size, draft_vocab, max_model_len, draft_positions)
    lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
    lo, hi = (DEFAULT_LOOKUP, DEFAULT_LOOKUP) if lo is None and hi is None else (lo if lo is not None else hi,
                                                                                  hi if hi is not None else lo)
    return SpeculativeConfig(method=method, num_speculative_tokens=value["num_speculative_tokens"],
                             prompt_lookup_min=lo, prompt_lookup_max=hi,
                             draft_length=value.get("draft_length", "adaptive"))


def _draft_model_config(value: Mapping[str, Any], method: str, vocab_size: int,
                        draft_vocab: Callable[[str], int] | None, max_model_len: int | None,
                        draft_positions: Callable[[str], int] | None) -> SpeculativeConfig:
    """A draft model's config, refused with the values when the draft cannot stand in for the target: another
    vocabulary (the drafts would name other tokens), a shorter context than max_model_len (it could not draft for
    long requests), or a layout of its own over several ranks (it runs on the replica's driver rank alone)."""
    model = value.get("model")
    if method != "draft_model" or not isinstance(model, str) or not model:
        raise ValueError(f"speculative_config method={method!r} with model={model!r}: a draft model needs "
                         "method 'draft_model' (or none) and the path of its folder or .gguf file")
    tp = value.get("draft_tensor_parallel_size", 1)
    if tp != 1 or isinstance(tp, bool):
        raise ValueError(f"speculative_config draft_tensor_parallel_size={tp!r}: the draft model runs on the "
                         "replica's driver rank alone; only 1 is built")
    lookup = [key for key in LOOKUP_KEYS if key in value]
    if lookup:
        raise ValueError(f"speculative_config {lookup} apply to method 'ngram' only, not to a draft model "
                         f"({model!r})")
    if draft_vocab is not None:
        draft = draft_vocab(model)
        if draft != vocab_size:
            raise ValueError(f"speculative_config model={model!r} has a vocabulary of {draft} tokens; the target "
                             f"model's has {vocab_size}: a draft model must share the target's tokenizer")
    if draft_positions is not None and max_model_len is not None:
        positions = draft_positions(model)
        if positions < max_model_len:
            raise ValueError(f"speculative_config model={model!r} has a context of {positions} positions, shorter "
                             f"than max_model_len={max_model_len}: lower max_model_len or use a longer draft")
    return SpeculativeConfig(method="draft_model", num_speculative_tokens=value["num_speculative_tokens"],
                             model=model, draft_length=value.get("draft_length", "adaptive"))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
