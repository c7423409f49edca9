"""Per-request sampling settings, vLLM-compatible (no torch: the scheduler imports this)."""

from __future__ import annotations

from dataclasses import dataclass

from cpllm.structured.params import StructuredOutputsParams

MAX_LOGPROBS = 20
"""Largest number of top alternatives a request may ask for, per position."""

MAX_LOGIT_BIAS = 100.0
"""Largest |bias| logit_bias may add to a token (OpenAI's range is [-100, 100])."""

GREEDY_EPS = 1e-5
"""Temperatures below this sample greedily (dividing by them would overflow)."""


def _is_int(value: object) -> bool:
    # bool is a subclass of int, but `n=True` is a bug, not a count.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(kw_only=True, slots=True)
class SamplingParams:
    """How to pick the tokens of one request; validated when built."""

    n: int = 1
    """Number of sequences to sample for the prompt."""
    max_tokens: int | None = 16
    """Most tokens to generate per sequence; None = until the model's context is full."""
    temperature: float = 1.0
    """Softmax temperature; 0 (or below 1e-5) means greedy."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens whose mass reaches top_p."""
    top_k: int = 0
    """Keep the top_k most likely tokens; 0 or -1 turn it off."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the most likely one's."""
    seed: int | None = None
    """Seed of this request's own random generator; None = a random seed."""
    stop: str | list[str] | None = None
    """Strings that end generation (not included in the output by default); a list after init."""
    stop_token_ids: list[int] | None = None
    """Token ids that end generation, besides EOS; a list after init."""
    ignore_eos: bool = False
    """Keep generating after EOS."""
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token already generated."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it was already generated."""
    repetition_penalty: float = 1.0
    """Divides positive / multiplies negative logits of tokens in prompt or output."""
    logprobs: int | None = None
    """Return the sampled token's logprob plus this many top alternatives per step."""
    prompt_logprobs: int | None = None
    """Return each prompt token's logprob plus this many top alternatives."""
    min_tokens: int = 0
    """EOS and stop token ids are masked until this many tokens have been generated."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the detokenized text."""
    include_stop_str_in_output: bool = False
    """Keep the matched stop string at the end of the output text."""
    logit_bias: dict[int, float] | None = None
    """Added to the logits of these token ids before sampling (after penalties); values in [-100, 100]."""
    allowed_token_ids: list[int] | None = None
    """Only these ids may be sampled (every other logit is masked); None = any id."""
    bad_words_token_ids: list[list[int]] | None = None
    """Token sequences that may never be completed: the last id of each is masked when the output ends with the
    rest of it (the server tokenizes `bad_words` into these)."""
    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the output to a JSON schema, regex, choice or grammar (enforced by a token mask)."""
    guided_decoding: StructuredOutputsParams | None = None
    """vLLM's older name of structured_outputs; moved there at init (give one of the two)."""
    max_logprobs: int = MAX_LOGPROBS
    """Largest `logprobs` / `prompt_logprobs` allowed (vLLM's --max-logprobs; a server that allows the whole
    vocabulary passes its size)."""
    logprob_token_ids: list[int] | None = None
    """Report these token ids' logprobs at every sampled position in place of the top `logprobs` alternatives
    (the sampled token is always reported too)."""
    extra_args: dict | None = None
    """Arguments for extensions, as vLLM has them; cpllm reads `kv_transfer_params` (disaggregated prefill and
    decode: docs/disaggregated.md)."""

    def __post_init__(self) -> None:
        self._validate_counts()
        self._validate_distribution()
        self._validate_penalties()
        self._normalise_stops()
        self._validate_logit_bias()
        self._validate_token_lists()
        self._merge_guided_decoding()

    def _validate_counts(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an int >= 1 or None, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens={self.min_tokens} must be <= max_tokens={self.max_tokens}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= self.max_logprobs):
                raise ValueError(
                    f"{name} must be None or an int in [0, {self.max_logprobs}], got {value!r}"
                )
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")

    def _validate_distribution(self) -> None:
        if not _is_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an int >= -1 (0 or -1 = off), got {self.top_k!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")

    def _validate_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")

    def _normalise_stops(self) -> None:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        for s in stops:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty str, got {s!r} in stop={self.stop!r}")
        self.stop = stops
        ids = list(self.stop_token_ids or [])
        for t in ids:
            if not _is_int(t) or t < 0:
                raise ValueError(f"stop_token_ids must be ints >= 0, got {t!r}")
        self.stop_token_ids = ids

    def _validate_logit_bias(self) -> None:
        if self.logit_bias is None:
            return
        if not isinstance(self.logit_bias, dict):
            raise ValueError(f"logit_bias must be a dict of token id -> bias, got {self.logit_bias!r}")
        for token, bias in self.logit_bias.items():
            if not _is_int(token) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {token!r}")
            if not _is_number(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(
                    f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias!r} for {token}"
                )

    def _validate_token_lists(self) -> None:
        if self.allowed_token_ids is not None:
            ids = list(self.allowed_token_ids)
            if not ids or not all(_is_int(t) and t >= 0 for t in ids):
                raise ValueError(f"allowed_token_ids must be a non-empty list of ints >= 0, got {ids!r}")
            self.allowed_token_ids = ids
        if self.bad_words_token_ids is not None:
            words = [list(w) for w in self.bad_words_token_ids]
            if not all(w and all(_is_int(t) and t >= 0 for t in w) for w in words):
                raise ValueError(f"bad_words_token_ids must be non-empty lists of ints >= 0, got {words!r}")
            self.bad_words_token_ids = words
        if self.logprob_token_ids is not None:
            ids = list(self.logprob_token_ids)
            if not ids or not all(_is_int(t) and t >= 0 for t in ids):
                raise ValueError(f"logprob_token_ids must be a non-empty list of ints >= 0, got {ids!r}")
            self.logprob_token_ids = ids

    def _merge_guided_decoding(self) -> None:
        for name in ("structured_outputs", "guided_decoding"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, StructuredOutputsParams):
                raise ValueError(f"{name} must be a StructuredOutputsParams, got {type(value).__name__}")
        if self.guided_decoding is not None:
            if self.structured_outputs is not None and self.structured_outputs != self.guided_decoding:
                raise ValueError("structured_outputs and guided_decoding differ; give only structured_outputs")
            self.structured_outputs = self.guided_decoding

    @property
    def greedy(self) -> bool:
        """True when the token is the argmax (temperature 0 or below GREEDY_EPS)."""
        return self.temperature < GREEDY_EPS

    @property
    def top_k_or_none(self) -> int | None:
        """top_k as a count, or None when top-k filtering is off (0 or -1)."""
        return self.top_k if self.top_k > 0 else None

    @property
    def has_penalties(self) -> bool:
        """True when any of the three penalties changes the logits."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )
