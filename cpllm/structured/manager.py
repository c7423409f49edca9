"""The driver's per-sequence grammar state: bitmasks before sampling, advanced by each sampled token."""

from __future__ import annotations

import logging

import llguidance
import torch

from cpllm.model.tokenization.tokenizer import Tokenizer
from cpllm.structured.bitmask import allocate_bitmask
from cpllm.structured.compiler import GrammarCompiler
from cpllm.structured.params import StructuredOutputsParams

logger = logging.getLogger(__name__)


def _bit(index: int) -> int:
    """Bit `index` of an int32 word, as a signed value (bit 31 is the sign bit)."""
    return (1 << index) - (1 << 32) if index == 31 else 1 << index


class StructuredOutputManager:
    """One per engine (driver only). Sequences without a constraint cost nothing here."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...] = ()):
        self.compiler = GrammarCompiler(tokenizer, vocab_size, eos_token_ids)
        self._eos_token_ids = tuple(eos_token_ids or tokenizer.eos_token_ids)
        self._matchers: dict[str, llguidance.LLMatcher] = {}

    def check(self, params: StructuredOutputsParams | None) -> None:
        """Compiles (or finds in the cache) the grammar; ValueError if it is invalid."""
        if params is not None:
            self.compiler.matcher(params)

    def add(self, seq_id: str, params: StructuredOutputsParams | None) -> None:
        if params is not None:
            self._matchers[seq_id] = self.compiler.matcher(params)

    def remove(self, seq_id: str) -> None:
        self._matchers.pop(seq_id, None)

    def bitmask(self, seq_ids: list[str]) -> torch.Tensor | None:
        """[len(seq_ids), words] allowed next tokens (all bits set for unconstrained rows); None if none is."""
        rows = [(i, self._matchers[s]) for i, s in enumerate(seq_ids) if s in self._matchers]
        if not rows:
            return None
        # imported on first use: llguidance.torch loads torch.compile's machinery (seconds) at import
        import llguidance.torch

        mask = allocate_bitmask(len(seq_ids), self.compiler.vocab_size)
        for i, matcher in rows:
            llguidance.torch.fill_next_token_bitmask(matcher, mask, i)
            if matcher.is_error() or not mask[i].any():
                # The grammar allows nothing more (it failed): only EOS, so the sequence ends cleanly.
                mask[i] = 0
                for eos in self._eos_token_ids:
                    mask[i, eos // 32] |= _bit(eos % 32)
        return mask

    def accept(self, seq_id: str, token_id: int) -> bool:
        """Advances the sequence's grammar; True when the grammar is complete (nothing may follow)."""
        matcher = self._matchers.get(seq_id)
        if matcher is None:
            return False
        if not matcher.consume_token(token_id):
            # Cannot happen with the mask applied; end the sequence rather than generate unconstrained text.
            logger.error("sequence %s: token %d rejected by its grammar: %s", seq_id, token_id,
                         matcher.get_error().splitlines()[0] if matcher.get_error() else "")
            return True
        return matcher.is_stopped()
