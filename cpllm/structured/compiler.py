"""Compiles constraints into llguidance matchers for one tokenizer, with a cache of compiled grammars."""

from __future__ import annotations

import collections
import logging
import threading

import llguidance
import llguidance.hf

from cpllm.model.tokenization.tokenizer import Tokenizer
from cpllm.structured.grammar import grammar_text
from cpllm.structured.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

DEFAULT_CACHE_SIZE = 256
"""Compiled grammars kept (least recently used dropped first); a hit costs a deep copy (microseconds)."""


class GrammarCompiler:
    """Thread-safe: the server compiles ahead on a worker thread while the engine thread takes copies."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...] = (),
                 cache_size: int = DEFAULT_CACHE_SIZE):
        if cache_size < 1:
            raise ValueError(f"cache_size must be >= 1, got {cache_size}")
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        """Width of the model's logits (the bitmask covers it; ids the tokenizer lacks are never allowed)."""
        self._eos_token_ids = list(eos_token_ids or tokenizer.eos_token_ids)
        self._cache_size = cache_size
        self._cache: collections.OrderedDict[tuple, llguidance.LLMatcher] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self.hits = 0
        """Cache hits so far (for tests and logs)."""
        self.misses = 0
        """Grammars compiled so far."""

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the vocabulary, built on first use (about 0.5 s for a 49k vocabulary)."""
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self._tokenizer.hf_tokenizer, n_vocab=self.vocab_size,
                    eos_token=self._eos_token_ids or None)
            return self._ll_tokenizer

    def matcher(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A fresh matcher at the start of `params`' grammar; ValueError (naming the problem) if it is invalid."""
        key = params.key()
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return template.deep_copy()
        template = self._compile(params)  # outside the lock: big grammars take a while (GIL released)
        with self._lock:
            self.misses += 1
            self._cache[key] = template
            self._cache.move_to_end(key)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return template.deep_copy()

    def _compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        try:
            text = grammar_text(params)
        except ValueError:
            raise
        except Exception as exc:  # the converters raise assorted types; every one means "this input is bad"
            raise ValueError(f"invalid {params.kind} constraint: {exc}") from exc
        matcher = llguidance.LLMatcher(self.ll_tokenizer, text, log_level=0)
        if matcher.is_error():
            raise ValueError(f"invalid {params.kind} constraint: {_first_lines(matcher.get_error())}")
        return matcher


def _first_lines(message: str, limit: int = 6) -> str:
    """llguidance's errors end with a dump of parser state; the first lines say what is wrong."""
    lines = [line for line in message.strip().splitlines() if line.strip()]
    return "\n".join(lines[:limit])
