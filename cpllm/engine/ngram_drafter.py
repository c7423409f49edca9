"""Prompt-lookup drafting (torch-free, on the driver): guess a request's next tokens from its own tokens.

The last n tokens of prompt + output so far are looked up earlier in the same tokens, n from prompt_lookup_max
down to prompt_lookup_min (longest match first); the tokens that followed the most recent earlier occurrence are
the drafts. A copy of a passage of the prompt (a rewrite, a quote, an edit) is then drafted whole. Any guess is
safe: the verify step keeps only what the model itself would have produced (cpllm/engine/spec_decode.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from cpllm.config.speculative import SpeculativeConfig


class NgramDrafter:
    """Proposes up to k drafts for a token sequence; stateless between calls."""

    def __init__(self, config: SpeculativeConfig):
        self.k = config.num_speculative_tokens
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, token_ids: Sequence[int], limit: int | None = None) -> list[int]:
        """Drafts following `token_ids`, at most min(k, limit) of them; [] when no n-gram matches."""
        count = self.k if limit is None else min(self.k, limit)
        if count <= 0:
            return []
        match = longest_match(token_ids, self.min_n, self.max_n)
        if match is None:
            return []
        start, n = match
        return list(token_ids[start + n : start + n + count])


def longest_match(token_ids: Sequence[int], min_n: int, max_n: int) -> tuple[int, int] | None:
    """(start, n) of the earlier occurrence of the longest suffix of `token_ids` of n in [min_n, max_n] tokens,
    the most recent one among those of that length; the occurrence must be followed by a token (so the suffix
    itself is not one). None when not even min_n tokens match. One pass from the end."""
    total = len(token_ids)
    if total < 2:
        return None
    last = token_ids[-1]
    best_start, best_n = -1, 0
    for end in range(total - 2, -1, -1):  # end: the candidate's last token
        if token_ids[end] != last:
            continue
        n = 1
        while n < max_n and n <= end and token_ids[end - n] == token_ids[total - 1 - n]:
            n += 1
        if n > best_n:  # ties keep the more recent one, found first
            best_start, best_n = end - n + 1, n
            if n == max_n:
                break
    if best_n < min_n:
        return None
    return best_start, best_n
