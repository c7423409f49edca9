"""Which rows of a request's K/V each producer rank sends each consumer rank (pure: no torch, no sockets).

The two instances may differ in every layout knob: PCP, DCP, TP, the KV cache layout, the interleave and the block
size. A position's owner on either side is docs/context_parallel.md "KV layout" (`owner = (pos // I) % C` over the
side's KV-shard group), and a rank's KV heads are `parallel_dims.kv_heads_of_tp_rank`. The plan gives every
(position, KV head) that a consumer rank must hold exactly one producer rank holding it, so each row lands once on
each of its owners and nothing else moves; block ids and slots are each side's own business (`local_index` here,
the block tables there).

Ranks are replica-local (`pcp_rank * TP + tp_rank`, ParallelDims.rank_of with dp 0): a disaggregated instance is one
replica.
"""

from __future__ import annotations

from dataclasses import dataclass

from cpllm.distributed.parallel_dims import ParallelDims


@dataclass(kw_only=True, frozen=True, slots=True)
class CacheLayout:
    """One instance's KV placement: what the plan needs to know of its configuration."""

    dims: ParallelDims
    """Its parallel dims (DP must be 1: each replica would be its own instance)."""
    interleave: int
    """Consecutive positions kept on one KV-shard rank (`I`, --cp-kv-cache-interleave-size)."""
    block_size: int
    """Tokens per physical block in each rank's pool (the interleave divides it)."""

    def __post_init__(self) -> None:
        if self.dims.dp != 1:
            raise ValueError(f"a disaggregated instance is one replica: data_parallel_size={self.dims.dp}, need 1")
        for name in ("interleave", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.block_size % self.interleave:
            raise ValueError(f"interleave={self.interleave} must divide block_size={self.block_size}")

    @property
    def num_ranks(self) -> int:
        return self.dims.replica_size

    @property
    def shards(self) -> int:
        """`C`: the ranks one request's K/V is divided over."""
        return self.dims.kv_shard_size

    def owner(self, pos: int) -> int:
        """KV-shard rank that stores position `pos` (context_parallel.md "KV layout")."""
        return (pos // self.interleave) % self.shards

    def local_index(self, pos: int) -> int:
        """Index of `pos` in its owner's local sequence: its slot is block_table[i // block_size] * block_size +
        i % block_size."""
        return (pos // (self.shards * self.interleave)) * self.interleave + pos % self.interleave

    def shard_rank(self, rank: int) -> int:
        return self.dims.kv_shard_rank(rank)

    def heads(self, num_kv_heads: int, rank: int) -> range:
        """The global KV heads `rank` holds."""
        first, count = self.dims.kv_heads(num_kv_heads, rank)
        return range(first, first + count)

    def to_dict(self) -> dict:
        """Plain data for the wire (the producer tells the consumer its layout)."""
        d = self.dims
        return {"tp": d.tp, "pcp": d.pcp, "dcp": d.dcp, "kv_replicated": d.kv_replicated,
                "interleave": self.interleave, "block_size": self.block_size}

    @classmethod
    def from_dict(cls, data: dict) -> CacheLayout:
        dims = ParallelDims(tp=data["tp"], pcp=data["pcp"], dcp=data["dcp"], kv_replicated=data["kv_replicated"])
        return cls(dims=dims, interleave=data["interleave"], block_size=data["block_size"])


@dataclass(kw_only=True, frozen=True, slots=True)
class Move:
    """Rows one producer rank sends one consumer rank."""

    src_rank: int
    """Producer rank (replica-local) that holds the rows."""
    dst_rank: int
    """Consumer rank that owns them."""
    heads: range
    """Global KV heads moved (contiguous: both sides hold runs of heads)."""
    ranges: tuple[tuple[int, int], ...]
    """Positions moved, as ascending, disjoint [start, end) runs."""

    @property
    def num_positions(self) -> int:
        return sum(end - start for start, end in self.ranges)


@dataclass(kw_only=True, frozen=True, slots=True)
class ReshardPlan:
    """Every move of one request's K/V from the producer's layout to the consumer's."""

    num_tokens: int
    """Positions [first_token, num_tokens) move."""
    moves: tuple[Move, ...]
    """Ordered by (dst_rank, src_rank, first head)."""

    def to(self, dst_rank: int) -> tuple[Move, ...]:
        """What consumer rank `dst_rank` pulls."""
        return tuple(m for m in self.moves if m.dst_rank == dst_rank)

    def sent_by(self, src_rank: int) -> tuple[Move, ...]:
        return tuple(m for m in self.moves if m.src_rank == src_rank)

    first_token: int = 0
    """The first position that moves (those before it the consumer holds already: its own prefix-cache hit)."""


def plan_reshard(src: CacheLayout, dst: CacheLayout, num_kv_heads: int, num_tokens: int,
                 first_token: int = 0) -> ReshardPlan:
    """The moves of positions [first_token, num_tokens) of a request from `src`'s ranks to `dst`'s owners.

    Where several producer ranks hold a (position, head) (KV heads replicated over TP, the replicated KV layout),
    consumer rank d takes it from the d-th of them (mod their count), so copies spread the sending."""
    if not isinstance(num_tokens, int) or num_tokens < 0:
        raise ValueError(f"num_tokens must be an integer >= 0, got {num_tokens!r}")
    if not isinstance(first_token, int) or not 0 <= first_token <= num_tokens:
        raise ValueError(f"first_token must be an integer in [0, num_tokens={num_tokens}], got {first_token!r}")
    if not isinstance(num_kv_heads, int) or num_kv_heads < 1:
        raise ValueError(f"num_kv_heads must be an integer >= 1, got {num_kv_heads!r}")
    runs: dict[tuple[int, int, int, int], list[list[int]]] = {}
    assignments: dict[tuple[int, int], list[tuple[int, int, range]]] = {}
    pos = first_token
    while pos < num_tokens:
        # both owners are constant up to the next multiple of either interleave
        end = min(num_tokens, (pos // src.interleave + 1) * src.interleave,
                  (pos // dst.interleave + 1) * dst.interleave)
        key = (src.owner(pos), dst.owner(pos))
        if key not in assignments:
            assignments[key] = _assign(src, dst, num_kv_heads, *key)
        for d, s, heads in assignments[key]:
            ranges = runs.setdefault((d, s, heads.start, heads.stop), [])
            if ranges and ranges[-1][1] == pos:
                ranges[-1][1] = end
            else:
                ranges.append([pos, end])
        pos = end
    moves = tuple(Move(src_rank=s, dst_rank=d, heads=range(h0, h1), ranges=tuple((a, b) for a, b in r))
                  for (d, s, h0, h1), r in sorted(runs.items()))
    return ReshardPlan(num_tokens=num_tokens, moves=moves, first_token=first_token)


def _assign(src: CacheLayout, dst: CacheLayout, num_kv_heads: int, src_shard: int,
            dst_shard: int) -> list[tuple[int, int, range]]:
    """For a position held by producer shard `src_shard` and owned by consumer shard `dst_shard`: each consumer
    owner's (dst_rank, src_rank, heads) triples, its heads cut into runs by the producer rank chosen for each."""
    holders = [s for s in range(src.num_ranks) if src.shard_rank(s) == src_shard]
    out = []
    for d in range(dst.num_ranks):
        if dst.shard_rank(d) != dst_shard:
            continue
        chosen: list[tuple[int, int]] = []  # (src_rank, head), heads ascending
        for h in dst.heads(num_kv_heads, d):
            have = [s for s in holders if h in src.heads(num_kv_heads, s)]
            if not have:
                raise AssertionError(f"no producer rank of shard {src_shard} holds KV head {h}")  # placement bug
            chosen.append((have[d % len(have)], h))
        start = 0
        for i in range(1, len(chosen) + 1):
            if i == len(chosen) or chosen[i][0] != chosen[start][0] or chosen[i][1] != chosen[i - 1][1] + 1:
                out.append((d, chosen[start][0], range(chosen[start][1], chosen[i - 1][1] + 1)))
                start = i
    return out


def split_ranges(ranges: tuple[tuple[int, int], ...], max_positions: int) -> list[tuple[tuple[int, int], ...]]:
    """`ranges` cut, in order, into pieces of at most `max_positions` positions each (a message's worth)."""
    if not isinstance(max_positions, int) or max_positions < 1:
        raise ValueError(f"max_positions must be an integer >= 1, got {max_positions!r}")
    pieces: list[tuple[tuple[int, int], ...]] = []
    piece: list[tuple[int, int]] = []
    room = max_positions
    for start, end in ranges:
        while start < end:
            take = min(end - start, room)
            piece.append((start, start + take))
            start, room = start + take, room - take
            if room == 0:
                pieces.append(tuple(piece))
                piece, room = [], max_positions
    if piece:
        pieces.append(tuple(piece))
    return pieces
