"""How many drafts a request takes into its next verify step (speculative decoding, torch-free).

A verify step of r rows is not free: on one CPU rank a step of 9 rows cost about 2.6 times a step of one (docs/
benchmarks.md), so drafts that are mostly rejected slow a request down. Under `draft_length="adaptive"` each
request keeps a limit of its own, k to start with: a step that accepts every draft doubles it (up to k), and a
step that rejects one sets it to the drafts accepted plus one, so that a request whose drafts keep failing drafts
one token a step (two rows) and one that copies its prompt drafts k. Which drafts are proposed never changes what
the request emits (the verify step keeps only the target's own tokens), only how many steps it takes.
"""

from __future__ import annotations


def next_draft_limit(limit: int, drafted: int, accepted: int, k: int) -> int:
    """The request's draft limit after a verify step that scored `drafted` drafts and kept `accepted`, from
    `limit` (1 <= limit <= k)."""
    if drafted == 0:
        return limit
    if accepted == drafted:
        return min(k, 2 * limit)
    return max(1, min(k, accepted + 1))
