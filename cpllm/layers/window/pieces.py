"""Sliding windows on the pieces of a CP attention (docs/context_parallel.md, "Windows, soft-capping and sinks").

A window `W` is a mask on absolute positions: key position `j` is visible to query position `i` iff
`i - W < j <= i` (transformers' sliding-window overlay). Every piece of a CP attention (a run of queries against a
run of new keys, or against one rank's shard of the cached context, or a decode row against its shard) applies it
on its own keys, so the log-sum-exp merge of the pieces stays exact: each partial is softmax over exactly the keys
of its piece that the window keeps. What this module decides for a piece, from positions alone (plain ints, no
tensor read):
- which of its keys can be visible at all (the window trims a run of keys to a suffix: keys at or after
  `first query - W + 1`) and which queries see any of them (those before `last key + W`), and skip the piece when
  none is (no attend call: that is where a window saves time);
- whether the keys left are visible to every query left (no mask: the backend's fastest kernel), or need a band
  mask built from positions; a run longer than the window against itself goes in query blocks of unmasked
  calls (`_banded_run`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpllm.context_parallel.kv_layout import KVLayout


QUERY_BLOCK = 1024
"""A query run longer than this and than the window attends itself in blocks of this many queries (each block's
own keys plus the window before it), so its mask and its work grow with run x (block + window), not run^2."""


@dataclass(frozen=True, slots=True)
class Piece:
    """One attend call: some queries of a run against part of a key run (rows of the key buffer)."""

    queries: slice
    """The run's query rows the call computes, counted from the run's first row (the window trims the queries
    too: only the first ones of a run see keys before it)."""
    keys: slice
    """Rows of the key run's buffer the call reads (already trimmed to the window)."""
    causal: bool
    """The keys are the queries' own positions and the window does not bite among them: square causal, no
    mask."""
    mask: torch.Tensor | None
    """[L, S] bool, True keeps: the band the window leaves (causality included), or None (every key visible to
    every query, or `causal`)."""
    reverse: bool = False
    """With `causal`, the far edge of the band instead: as many keys as queries, ending W - 1 positions before
    the last query, query t seeing key s iff s >= t; computed as the causal call on both runs reversed (the C
    kernel, no mask)."""

    def rows(self, first_row: int) -> slice:
        """The queries' rows in a batch whose run starts at `first_row`."""
        return slice(first_row + self.queries.start, first_row + self.queries.stop)


def band_mask(q_positions: torch.Tensor, k_positions: torch.Tensor, window: int | None) -> torch.Tensor:
    """[L, S] bool: key j visible to query i (k <= q, and k > q - window when there is one)."""
    diff = q_positions.unsqueeze(1) - k_positions.unsqueeze(0)  # [L, S]
    keep = diff >= 0
    if window is not None:
        keep &= diff < window
    return keep


def _before(q_first: int, q_len: int, keys: slice, first_key: int, last_key: int, key_positions,
            window: int | None, q_offset: int = 0) -> Piece:
    """Queries at positions [q_first, q_first + q_len) against keys all before them, already trimmed to the first
    query's window (first_key >= q_first - window + 1): only the queries before last_key + window see any of them,
    and the call is unmasked where the last of those still sees the first key."""
    q_stop = q_len if window is None else min(q_len, last_key + window - q_first)
    q_last = q_first + q_stop - 1
    mask = None
    if window is not None and first_key <= q_last - window:
        mask = band_mask(torch.arange(q_first, q_last + 1), key_positions(), window)
    return Piece(slice(q_offset, q_offset + q_stop), keys, False, mask)


def _own_run(key_row: int, q_start: int, q_len: int, window: int | None) -> list[Piece]:
    """A query run against its own keys: one causal call where the window does not bite inside it, else
    `_banded_run` (windows of 2 or more), else one band-masked call up to QUERY_BLOCK queries or blocks of
    QUERY_BLOCK queries, each its own keys (causal, or banded when the block is longer than the window) and the
    window's keys before it in the run."""
    if window is None or q_len <= window:
        return [Piece(slice(0, q_len), slice(key_row, key_row + q_len), True, None)]
    if window >= 2:
        return _banded_run(key_row, q_start, q_len, window)
    block = q_len if q_len <= QUERY_BLOCK else QUERY_BLOCK
    pieces = []
    for a in range(0, q_len, block):
        b = min(a + block, q_len)
        if b - a <= window:
            pieces.append(Piece(slice(a, b), slice(key_row + a, key_row + b), True, None))
        else:
            idx = torch.arange(b - a)
            pieces.append(Piece(slice(a, b), slice(key_row + a, key_row + b), False, band_mask(idx, idx, window)))
        lo = max(a - window + 1, 0)
        if lo < a:  # the window's keys of the run before this block
            pieces.append(_before(q_start + a, b - a, slice(key_row + lo, key_row + a), q_start + lo,
                                  q_start + a - 1, lambda lo=lo, a=a: torch.arange(q_start + lo, q_start + a),
                                  window, q_offset=a))
    return pieces


def _banded_run(key_row: int, q_start: int, q_len: int, window: int) -> list[Piece]:
    """A run longer than its window, with no mask where the window lies wholly inside the run: blocks of
    n <= min(W - 1, QUERY_BLOCK) queries [a, a + n), each three unmasked calls whose key sets partition its band:
    its own keys (causal: the window cannot bite within n < W), the keys [a + n - W + 1, a) every query of the
    block sees, and the band's far edge [a - W + 1, a - W + n] (`reverse`). Work ~ run x W, no score wasted but
    the diagonals'. Blocks within a window of the run's start see keys from its first on (`_before`, masked)."""
    block = min(window - 1, QUERY_BLOCK)
    pieces = []
    for a in range(0, q_len, block):
        b = min(a + block, q_len)
        pieces.append(Piece(slice(a, b), slice(key_row + a, key_row + b), True, None))
        if a - window + 1 < 0:  # the band starts before the run: its first keys are all the block can see
            if a > 0:
                pieces.append(_before(q_start + a, b - a, slice(key_row, key_row + a), q_start, q_start + a - 1,
                                      lambda a=a: torch.arange(q_start, q_start + a), window, q_offset=a))
            continue
        if b - window + 1 < a:  # keys every query of the block sees
            pieces.append(Piece(slice(a, b), slice(key_row + b - window + 1, key_row + a), False, None))
        edge = key_row + a - window + 1
        pieces.append(Piece(slice(a, b), slice(edge, edge + b - a), True, None, reverse=True))
    return pieces


def new_key_pieces(source_rows, q_start: int, q_len: int, mods) -> list[Piece]:
    """The attend calls of a query run (new-token indices [q_start, q_start + q_len)) against one source's key
    runs [(row in the block, first new-token index, length)]: the run itself (causal, banded or in blocks), runs
    wholly before it (keys trimmed to the window, queries to those that see them, unmasked where all of those see
    all of them), runs after it or out of the window skipped. The request's start position cancels: new-token
    indices are positions up to one offset."""
    window, pieces = mods.window, []
    for key_row, key_start, key_len in source_rows:
        if key_len == 0:
            continue
        if key_start == q_start:  # the run itself
            pieces += _own_run(key_row, q_start, q_len, window)
            continue
        end = key_start + key_len
        if end > q_start:
            continue  # after the run (head-tail chunks never overlap otherwise)
        lo = max(key_start, mods.first_visible(q_start))
        if lo >= end:
            continue  # wholly out of the window: no call
        pieces.append(_before(q_start, q_len, slice(key_row + lo - key_start, key_row + key_len), lo, end - 1,
                              lambda lo=lo, end=end: torch.arange(lo, end), window))
    return pieces


def local_positions(layout: KVLayout, start: int, end: int) -> torch.Tensor:
    """[end - start] absolute positions of this rank's local context indices [start, end) (ascending)."""
    local = torch.arange(start, end)
    return torch.div(local, layout.interleave, rounding_mode="floor") * layout.cycle \
        + layout.shard_rank * layout.interleave + local % layout.interleave


def context_range(layout: KVLayout, context_len: int, q_first: int, mods) -> tuple[int, int]:
    """Local indices [lo, hi) of this rank's cached context (positions < context_len) that queries at or after
    position `q_first` can see: a suffix of its shard."""
    return layout.num_local_tokens(mods.first_visible(q_first)), layout.num_local_tokens(context_len)


def context_piece(layout: KVLayout, context_len: int, lo_base: int, q_first: int, q_len: int,
                  mods) -> Piece | None:
    """The attend call of queries at positions [q_first, q_first + q_len) against this rank's cached context, read
    from local index `lo_base` on (rows of the key buffer count from there); None when the window leaves none
    of its keys. Every cached position lies before every query of the run, so only the window masks (and trims
    the queries: only those within a window of the last cached key see any)."""
    lo, hi = context_range(layout, context_len, q_first, mods)
    lo = max(lo, lo_base)
    if lo >= hi:
        return None
    return _before(q_first, q_len, slice(lo - lo_base, hi - lo_base), layout.local_position(lo),
                   layout.local_position(hi - 1), lambda: local_positions(layout, lo, hi), mods.window)
