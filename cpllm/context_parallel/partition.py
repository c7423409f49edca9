"""Load-balanced head-tail split of a request's new tokens over PCP ranks.

Causal attention makes late tokens more expensive than early ones (they see more
keys). Cutting the new tokens into `2 * pcp_size` equal chunks and giving rank
`p` both chunk `p` (cheap, near the head) and chunk `2 * pcp_size - 1 - p`
(expensive, near the tail) evens out the attention work across ranks
(docs/context_parallel.md, "Prefill partition"). Pure Python, no torch: the scheduler side may use it too.

Worked example, `T = 10`, `pcp_size = 2`: chunk length 3, chunks
`[0,3) [3,6) [6,9) [9,10)`; rank 0 computes tokens 0-2 and 9, rank 1 tokens 3-8.

`key_runs` turns one rank's runs into the attention calls a query run makes against them (ring and pass-Q);
`joined_key_runs` joins a causal run to the keys just before it where the backend takes a causal offset.
"""

from __future__ import annotations


def _check(num_tokens: int, pcp_size: int) -> None:
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    if pcp_size < 1:
        raise ValueError(f"pcp_size must be >= 1, got {pcp_size}")


def _check_rank(pcp_size: int, pcp_rank: int) -> None:
    if not 0 <= pcp_rank < pcp_size:
        raise ValueError(f"pcp_rank={pcp_rank} is outside [0, pcp_size={pcp_size})")


def head_tail_chunks(num_tokens: int, pcp_size: int) -> list[tuple[int, int]]:
    """The `2 * pcp_size` chunks `[start, end)` of the new tokens, in order.

    Chunk length is `ceil(num_tokens / (2 * pcp_size))`; chunks past the end are
    empty (`start == end == num_tokens`), so the list always has `2 * pcp_size`
    entries and their union is exactly `[0, num_tokens)`.
    """
    _check(num_tokens, pcp_size)
    num_chunks = 2 * pcp_size
    chunk = -(-num_tokens // num_chunks)
    return [
        (min(i * chunk, num_tokens), min((i + 1) * chunk, num_tokens)) for i in range(num_chunks)
    ]


def rank_token_ranges(num_tokens: int, pcp_size: int, pcp_rank: int) -> list[tuple[int, int]]:
    """The non-empty ranges `[start, end)` of new-token indices that `pcp_rank` computes.

    Chunks `pcp_rank` and `2 * pcp_size - 1 - pcp_rank`, in that (ascending)
    order, with empty ones dropped, and joined into one range where they touch
    (one PCP rank: the whole prompt is one run, so attention runs as one causal
    call instead of two pieces and a merge). A decode-like request
    (`num_tokens == 1`) is not split: every rank computes it and gets `[(0, 1)]`.
    """
    _check(num_tokens, pcp_size)
    _check_rank(pcp_size, pcp_rank)
    if num_tokens == 1:
        return [(0, 1)]
    chunks = head_tail_chunks(num_tokens, pcp_size)
    head = chunks[pcp_rank]
    tail = chunks[2 * pcp_size - 1 - pcp_rank]
    if head[1] == tail[0]:
        return [(head[0], tail[1])] if tail[1] > head[0] else []
    return [r for r in (head, tail) if r[1] > r[0]]


def rank_token_indices(num_tokens: int, pcp_size: int, pcp_rank: int) -> list[int]:
    """The new-token indices `pcp_rank` computes, ascending (flattened `rank_token_ranges`)."""
    return [i for s, e in rank_token_ranges(num_tokens, pcp_size, pcp_rank) for i in range(s, e)]


def rank_num_tokens(num_tokens: int, pcp_size: int, pcp_rank: int) -> int:
    """How many new tokens `pcp_rank` computes (length of `rank_token_indices`)."""
    return sum(e - s for s, e in rank_token_ranges(num_tokens, pcp_size, pcp_rank))


def key_runs(source_rows, query_start: int) -> list[tuple[slice, bool]]:
    """The attention calls of a query run starting at new-token index `query_start` against one source's key
    runs [(row in the block, first new-token index, length)]: the run itself square-causal, runs wholly before it
    unmasked (adjacent ones in the block joined into one call: one kernel call and one merge fewer), runs after
    it skipped."""
    calls: list[tuple[slice, bool]] = []
    for key_row, key_start, key_len in source_rows:
        if key_start == query_start:
            calls.append((slice(key_row, key_row + key_len), True))
        elif key_start + key_len <= query_start:
            last = calls[-1] if calls else None
            if last is not None and not last[1] and last[0].stop == key_row:
                calls[-1] = (slice(last[0].start, key_row + key_len), False)
            else:
                calls.append((slice(key_row, key_row + key_len), False))
    return calls


def joined_key_runs(source_rows, query_start: int) -> list[tuple[slice, int | None]]:
    """`key_runs` for a backend whose causal calls take an offset: the unmasked call just before the query run's own
    rows in the block joins it, as one call whose queries see its first `offset` keys and then themselves causally
    (one kernel call, one online softmax and one merge fewer). Each call: (keys, causal offset), None unmasked."""
    calls: list[tuple[slice, int | None]] = []
    for keys, causal in key_runs(source_rows, query_start):
        last = calls[-1] if calls else None
        if causal and last is not None and last[1] is None and last[0].stop == keys.start:
            calls[-1] = (slice(last[0].start, keys.stop), keys.start - last[0].start)
        else:
            calls.append((keys, 0 if causal else None))
    return calls
