"""What one layer caches: a kind's cache spec, read by everything that sizes or allocates caches (torch-free).

The pool allocator (cpllm/worker/kv_cache.py), the capacity log (cpllm/model/layer_kinds_log.py), the bench's
memory figures (cpllm/bench/common.py) and the draft model's pool read these records and never ask which kind
a layer is. A spec is per rank: the heads it counts are the ones this rank holds.
"""

from __future__ import annotations

from dataclasses import dataclass

FULL, SLIDING, LATENT, STATE = "full", "sliding", "latent", "state"
"""The cache kinds built today: every position's K/V rows; only a window's; one latent row per position; a
fixed-size recurrent state per request (its pools are indexed by the request's state slot, not by position)."""


@dataclass(kw_only=True, frozen=True, slots=True)
class PoolSpec:
    """One paged tensor a layer caches into: `[num_slots, heads, width]`."""

    name: str
    """What it holds ("k", "v", "latent"): the start-up log's and the tests' name for it."""
    heads: int
    """Rows of one slot (this rank's KV heads; 1 for a latent row)."""
    width: int
    """Values of one row."""

    @property
    def values_per_slot(self) -> int:
        return self.heads * self.width


@dataclass(kw_only=True, frozen=True, slots=True)
class CacheSpec:
    """One layer's cache on one rank (vLLM's KVCacheSpec idea): its pools and what one token costs in them."""

    kind: str
    """FULL, SLIDING or LATENT: what the cache keeps (a window keeps the last `window` positions)."""
    pools: tuple[PoolSpec, ...]
    """The paged tensors of one layer, all indexed by the same slots."""
    element_bytes: int
    """Bytes of one cached value (the KV cache dtype's)."""
    window: int | None = None
    """SLIDING: positions a query still reads (q - W < j <= q); None otherwise."""
    shared_kv: bool = False
    """The layer reads its one pool as both keys and values (a latent row is both); its cache tuple is then
    (pool, pool), one tensor."""

    def __post_init__(self) -> None:
        if not self.pools:
            raise ValueError(f"a {self.kind} cache spec needs at least one pool")
        if self.shared_kv and len(self.pools) != 1:
            raise ValueError(f"shared_kv: one pool read as K and V, got {len(self.pools)}")
        if (self.kind == SLIDING) != (self.window is not None):
            raise ValueError(f"cache kind {self.kind!r} with window={self.window!r}: only a sliding cache has one")

    @property
    def bytes_per_token(self) -> int:
        """Bytes one cached position costs in this layer on this rank."""
        if self.kind == STATE:
            return 0
        return sum(pool.values_per_slot for pool in self.pools) * self.element_bytes

    @property
    def bytes_per_request(self) -> int:
        """Bytes held per request whatever its length (a recurrent state's); 0 for row caches."""
        if self.kind != STATE:
            return 0
        return sum(pool.values_per_slot for pool in self.pools) * self.element_bytes

    def block_bytes(self, block_size: int) -> int:
        """Bytes of one block of `block_size` slots of this layer."""
        return block_size * self.bytes_per_token

    def tokens_kept(self, length: int) -> int:
        """Positions of a `length`-token request the cache holds at once (a window's last W)."""
        return length if self.window is None else min(self.window, length)

    def describe(self) -> str:
        what = {FULL: "K/V rows", SLIDING: f"K/V rows of a {self.window}-token window",
                LATENT: "latent rows", STATE: "recurrent state"}.get(self.kind, self.kind)
        widths = " + ".join(f"{pool.name} {pool.heads}x{pool.width}" for pool in self.pools)
        if self.kind == STATE:
            return f"{what} ({widths} values per request, {self.bytes_per_request} bytes)"
        return f"{what} ({widths} values per token, {self.bytes_per_token} bytes)"
