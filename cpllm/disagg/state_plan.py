"""Which rows of a request's linear-attention states each producer rank sends each consumer rank (pure: no torch).

A state layer's pools are split over TP only (cpllm/layers/kind.py `state_rows`): the PCP ranks of one TP rank
hold the same copy, while DCP ranks, being distinct TP ranks, hold distinct rows. A pool's rows on a rank are runs
of the whole layer's rows in the rank's local order (the gated DeltaNet's convolution: three runs, its q, k and v
channels), so a change of TP size maps local rows of one side onto local rows of the other through those global
rows. The plan gives every local row of every consumer rank's pools exactly one producer rank holding it, and
spreads the consumer ranks over the PCP copies as plan_reshard (reshard.py) spreads them over KV heads' copies.
State slots are each side's own business: a move names rows of a pool, the same in whichever slot holds the
request's state.

Ranks are replica-local (`pcp_rank * TP + tp_rank`), as in reshard.py.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable

from cpllm.disagg.reshard import CacheLayout

Runs = tuple[tuple[int, int], ...]
"""[start, end) runs of rows, in order."""
RowsOf = Callable[[int, int], tuple[Runs, ...]]
"""(tp_size, tp_rank) -> for each pool, the global rows that TP rank holds in its local order (a kind's
`state_rows` with the model config bound)."""


@dataclass(kw_only=True, frozen=True, slots=True)
class StateMove:
    """Rows of one state pool that one producer rank sends one consumer rank."""

    src_rank: int
    """Producer rank (replica-local) that holds the rows."""
    dst_rank: int
    """Consumer rank that holds them after the move."""
    pool: int
    """Index of the pool in the layer's state spec (0: `conv`, 1: `delta` for both state kinds)."""
    src_local: Runs
    """The rows in the producer rank's pool, as [start, end) runs of its local rows, paired with `dst_local`."""
    dst_local: Runs
    """Where they land in the consumer rank's pool, ascending: run i of `src_local` goes to run i here (the same
    length)."""

    @property
    def num_rows(self) -> int:
        return sum(end - start for start, end in self.src_local)


@dataclass(kw_only=True, frozen=True, slots=True)
class StatePlan:
    """Every move of one state layer's pools from the producer's layout to the consumer's (alike for every state
    layer of a kind, and for every request)."""

    num_pools: int
    """Pools of one state layer."""
    moves: tuple[StateMove, ...]
    """Ordered by (dst_rank, pool, first consumer row)."""

    def to(self, dst_rank: int) -> tuple[StateMove, ...]:
        """What consumer rank `dst_rank` pulls."""
        return tuple(m for m in self.moves if m.dst_rank == dst_rank)

    def sent_by(self, src_rank: int) -> tuple[StateMove, ...]:
        return tuple(m for m in self.moves if m.src_rank == src_rank)


@dataclass(frozen=True, slots=True)
class _Held:
    """A run of a pool's global rows held by one producer TP rank."""

    start: int
    end: int
    tp_rank: int
    local: int
    """The local row of `start` on that rank."""


def plan_states(src: CacheLayout, dst: CacheLayout, rows_of: RowsOf) -> StatePlan:
    """The moves that give every consumer rank of `dst` its state rows from the producer ranks of `src`.

    Consumer rank d takes a row from the d-th (mod their number) of the producer ranks holding its TP shard (the
    PCP copies), so that the sending spreads over the copies."""
    src_rows = _rows_by_tp_rank(rows_of, src.dims.tp, "producer")
    dst_rows = _rows_by_tp_rank(rows_of, dst.dims.tp, "consumer")
    num_pools = len(src_rows[0])
    if len(dst_rows[0]) != num_pools:
        raise ValueError(f"the consumer's state layers have {len(dst_rows[0])} pools, the producer's {num_pools}")
    copies = [[s for s in range(src.num_ranks) if src.dims.coords(s)[2] == t] for t in range(src.dims.tp)]
    moves = []
    for pool in range(num_pools):
        held = _held(src_rows, pool, src.dims.tp)
        for d in range(dst.num_ranks):
            t = dst.dims.coords(d)[2]
            pieces = _cover(dst_rows[t][pool], held, pool, dst.dims.tp, t, src.dims.tp)
            moves += _moves(pieces, d, pool, [ranks[d % len(ranks)] for ranks in copies])
    moves.sort(key=lambda m: (m.dst_rank, m.pool, m.dst_local[0][0]))
    return StatePlan(num_pools=num_pools, moves=tuple(moves))


def _rows_by_tp_rank(rows_of: RowsOf, tp_size: int, side: str) -> list[tuple[Runs, ...]]:
    """`rows_of` of every TP rank of one side, each checked, all with the same number of pools."""
    rows = [_checked(tuple(rows_of(tp_size, t)), tp_size, t) for t in range(tp_size)]
    counts = sorted({len(r) for r in rows})
    if len(counts) != 1 or counts[0] < 1:
        raise ValueError(f"the {side}'s TP ranks (tp_size={tp_size}) give {counts} state pools: need one count >= 1")
    return rows


def _checked(rows: tuple[Runs, ...], tp_size: int, tp_rank: int) -> tuple[Runs, ...]:
    """`rows` refused unless every run is a non-empty [start, end) of rows >= 0."""
    for pool, runs in enumerate(rows):
        for run in runs:
            if not (len(run) == 2 and all(isinstance(x, int) for x in run) and 0 <= run[0] < run[1]):
                raise ValueError(f"pool {pool} of TP rank {tp_rank} (tp_size={tp_size}): run {run!r} is not a "
                                 "non-empty [start, end) of rows >= 0")
    return rows


def _held(src_rows: list[tuple[Runs, ...]], pool: int, src_tp: int) -> list[_Held]:
    """Every producer TP rank's runs of `pool`, sorted by global start; refused where two ranks hold a row (a
    state is split over TP, never replicated: the plan would not know whose copy is current)."""
    held = []
    for t, rows in enumerate(src_rows):
        local = 0
        for start, end in rows[pool]:
            held.append(_Held(start, end, t, local))
            local += end - start
    held.sort(key=lambda h: h.start)
    for a, b in zip(held, held[1:]):
        if b.start < a.end:
            raise ValueError(f"global row {b.start} of state pool {pool} is held twice: by producer TP rank "
                             f"{a.tp_rank} and by {b.tp_rank} of tp_size={src_tp}")
    return held


def _cover(wanted: Runs, held: list[_Held], pool: int, dst_tp: int, dst_tp_rank: int,
           src_tp: int) -> list[tuple[int, int, int, int]]:
    """The consumer rank's `wanted` global runs cut where the producer TP rank holding them changes: (producer TP
    rank, producer local row, consumer local row, length) per piece, in the consumer's local order."""
    starts = [h.start for h in held]
    pieces, local = [], 0
    for start, end in wanted:
        row = start
        while row < end:
            i = bisect.bisect_right(starts, row) - 1
            if i < 0 or held[i].end <= row:
                raise ValueError(f"global row {row} of state pool {pool} (on consumer TP rank {dst_tp_rank} of "
                                 f"tp_size={dst_tp}) is held by no producer TP rank of tp_size={src_tp}")
            h = held[i]
            length = min(end, h.end) - row
            pieces.append((h.tp_rank, h.local + row - h.start, local, length))
            row, local = row + length, local + length
    return pieces


def _moves(pieces: list[tuple[int, int, int, int]], dst_rank: int, pool: int,
           sender: list[int]) -> list[StateMove]:
    """One move per producer rank (`sender[t]` sends the pieces of producer TP rank t), its pieces in the
    consumer's local order, runs joined where both sides' rows continue."""
    runs: dict[int, list[list[int]]] = {}  # src_rank -> [src start, dst start, length] per run
    for tp_rank, src_local, dst_local, length in pieces:
        mine = runs.setdefault(sender[tp_rank], [])
        if mine and mine[-1][0] + mine[-1][2] == src_local and mine[-1][1] + mine[-1][2] == dst_local:
            mine[-1][2] += length
        else:
            mine.append([src_local, dst_local, length])
    return [StateMove(src_rank=s, dst_rank=dst_rank, pool=pool, src_local=tuple((a, a + n) for a, _, n in r),
                      dst_local=tuple((b, b + n) for _, b, n in r)) for s, r in runs.items()]
