"""The exclusive scan of per-request recurrent states over PCP ranks (docs/context_parallel.md, "State scan").

A layer whose per-request state S evolves as an affine map of each token (S <- A_t S + b_t, a linear recurrence)
runs a prompt split over PCP ranks as follows: each rank runs its runs of tokens from a zero state and also obtains
each run's transition, so a run maps its initial state S_in to S_end = M S_in + B. The ranks all-gather (M, B) of
every run, compose them in sequence order from the request's initial state, and so each run gets its true S_in and
every rank the final state. Nothing here knows what the state is: the kind supplies M and B.

Shapes: a state [H, dk, dv] (H independent heads, the map acting on dk), a transition M [H, dk, dk].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpllm.distributed.parallel_context import GroupComm


@dataclass(kw_only=True, frozen=True, slots=True)
class Run:
    """One contiguous run of a request's new tokens on one PCP rank (metadata `source_rank_rows`)."""

    rank: int
    """The PCP rank holding it."""
    row: int
    """Its first row in that rank's batch."""
    start: int
    """Index of its first token among the request's new tokens."""
    length: int
    """Tokens in the run (> 0)."""

    @property
    def end(self) -> int:
        return self.start + self.length


def sequence_runs(source_rank_rows) -> list[Run]:
    """Every rank's runs of one request, in sequence order; `source_rank_rows[p]` is rank p's (row, new_start,
    length) runs (cpllm/context_parallel/metadata.py `RequestAttention.source_rank_rows`)."""
    runs = [Run(rank=p, row=row, start=start, length=length)
            for p, rank_runs in enumerate(source_rank_rows) for row, start, length in rank_runs if length]
    return sorted(runs, key=lambda run: run.start)


def gather_pieces(comm: GroupComm, pieces: list[torch.Tensor], counts: list[int],
                  like: torch.Tensor) -> list[list[torch.Tensor]]:
    """All-gather a list of equally shaped tensors per rank: this rank's `pieces`, `counts[p]` pieces on rank p
    (every rank knows every count from the step's metadata, so the collective is the same on all; the lists are
    padded to the longest, as gloo gathers equal sizes only). `like`: a tensor of the pieces' shape and dtype (for
    a rank with none). Returns each rank's pieces, in rank order."""
    if len(pieces) != counts[comm.rank]:
        raise ValueError(f"{len(pieces)} pieces on PCP rank {comm.rank}, the metadata says {counts[comm.rank]}")
    most = max(counts)
    if most == 0:
        return [[] for _ in counts]
    padded = torch.zeros(most, *like.shape, dtype=like.dtype, device=like.device)
    if pieces:
        padded[: len(pieces)] = torch.stack(pieces)
    gathered = comm.all_gather(padded.unsqueeze(0)) if comm.size > 1 else padded.unsqueeze(0)  # [P, most, ...]
    return [[gathered[p, i] for i in range(count)] for p, count in enumerate(counts)]


def exclusive_scan(transitions: list[tuple[torch.Tensor, torch.Tensor]],
                   initial: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(M [H, dk, dk], B [H, dk, dv]) of each run in sequence order, and the state before the first run
    [H, dk, dv] -> (each run's initial state, the state after the last run). Composed in float32, in order: the
    same products on every rank, so every rank ends with the same state."""
    state, starts = initial.float(), []
    for m, b in transitions:
        starts.append(state)
        state = m @ state + b
    return starts, state


def preceding_rows(start: int, width: int, runs: list[Run], tails: dict[Run, torch.Tensor],
                   window: torch.Tensor) -> torch.Tensor:
    """The `width` input rows before new token `start` (the halo of a short causal convolution) -> [width, C]:
    from the runs' last rows `tails[run]` [width, C] (front-padded when a run is shorter) or, before the first new
    token, from `window` [width, C] (the inputs before the chunk, the last one last).

    A row at distance j <= width before `start` lies within the last j rows of the run holding it (runs cover the
    tokens contiguously), so each run's last `width` rows are all a halo ever needs."""
    rows = []
    for index in range(start - width, start):
        if index < 0:
            rows.append(window[width + index])
            continue
        run = next(r for r in runs if r.start <= index < r.end)
        rows.append(tails[run][width - (run.end - index)])
    return torch.stack(rows) if rows else window[:0]
