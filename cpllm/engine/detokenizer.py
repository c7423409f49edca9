"""Incremental detokenization and stop strings for one sequence (no torch).

Decoding the whole output every step costs O(length) per token; instead only a
short window of ids is decoded: the ids from `_prefix` on, compared with the
text of the ids in [_prefix, _read). Byte-level tokenizers split a multi-byte
character over several tokens; while the window's text ends in U+FFFD the
character is incomplete, so nothing is emitted until a later token completes it.
"""

from __future__ import annotations

from typing import Protocol

from cpllm.engine.sampling_params import SamplingParams

PROMPT_CONTEXT_TOKENS = 5
"""Prompt tokens decoded with the first output tokens, so that tokenizers which
drop a word's leading space at the start of a decode still produce it."""

REPLACEMENT_CHAR = "\ufffd"


class Tokenizer(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Feeds one sequence's tokens, keeps its text, finds stop strings, streams new text.

    Feed only tokens that belong to the output: a token that ended the
    sequence as EOS / stop id is left out, as vLLM does.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self._tokenizer = tokenizer
        self._params = params
        self._stops: list[str] = list(params.stop or [])
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._ids: list[int] = context
        """Window ids: prompt context, then every output token."""
        self._prefix = 0
        self._read = len(context)
        self.num_tokens = 0
        """Output tokens appended so far."""
        self.text = ""
        """Output text so far (without held-back partial characters)."""
        self.stop_reason: str | None = None
        """The stop string that ended the sequence, once one matched."""
        self._finished = False
        self._streamed = 0

    @property
    def finished(self) -> bool:
        """True after a stop string matched or finish() was called."""
        return self._finished

    def append(self, token_id: int) -> str | None:
        """Adds one generated token; returns the stop string if the text now contains one."""
        if self._finished:
            raise RuntimeError(
                f"append({token_id}) after the sequence finished (stop_reason={self.stop_reason!r})"
            )
        self._ids.append(token_id)
        self.num_tokens += 1
        added = self._decode_new()
        if not added:
            return None
        self.text += added
        # vLLM does not look for stop strings until min_tokens tokens exist.
        if self._stops and self.num_tokens > self._params.min_tokens:
            return self._check_stop(len(added))
        return None

    def finish(self) -> None:
        """Ends the sequence (EOS, length, abort): flushes held-back text, even incomplete."""
        if self._finished:
            return
        skip = self._params.skip_special_tokens
        prefix_text = self._tokenizer.decode(self._ids[self._prefix : self._read], skip_special_tokens=skip)
        full = self._tokenizer.decode(self._ids[self._prefix :], skip_special_tokens=skip)
        if len(full) > len(prefix_text):
            self.text += full[len(prefix_text) :]
        self._finished = True

    def new_text(self) -> str:
        """Text added since the last call, minus a suffix that a stop string might still claim."""
        end = len(self.text)
        if not self._finished and not self._params.include_stop_str_in_output:
            end -= self._pending_stop_prefix()
        end = max(end, self._streamed)
        chunk = self.text[self._streamed : end]
        self._streamed = end
        return chunk

    def _decode_new(self) -> str:
        """Text that the newest token completed ("" while a character is still partial)."""
        skip = self._params.skip_special_tokens
        prefix_text = self._tokenizer.decode(self._ids[self._prefix : self._read], skip_special_tokens=skip)
        full = self._tokenizer.decode(self._ids[self._prefix :], skip_special_tokens=skip)
        if len(full) <= len(prefix_text) or full.endswith(REPLACEMENT_CHAR):
            return ""
        # Keep the last completed ids as context for the next window.
        self._prefix = self._read
        self._read = len(self._ids)
        return full[len(prefix_text) :]

    def _check_stop(self, num_new_chars: int) -> str | None:
        """Earliest stop string that ends in the newly added text; truncates the text at it."""
        old_len = len(self.text) - num_new_chars
        best: tuple[int, str] | None = None
        for stop in self._stops:
            # Only matches that end inside the new text: older ones were checked already.
            idx = self.text.find(stop, max(0, old_len - len(stop) + 1))
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return None
        idx, stop = best
        cut = idx + len(stop) if self._params.include_stop_str_in_output else idx
        self.text = self.text[:cut]
        self.stop_reason = stop
        self._finished = True
        return stop

    def _pending_stop_prefix(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(self.text)), best, -1):
                if self.text.endswith(stop[:n]):
                    best = n
                    break
        return best
