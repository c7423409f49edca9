"""KV cache groups: a model's decoder layers grouped by what their K/V must keep (torch-free; docs/context_parallel.md,
"Windowed KV groups").

Layers of one layer kind and window form one group: full attention, or a sliding window of W tokens (several
distinct W make several groups). Each group has its own block pool on every rank (the tensors its kind's cache spec
names, per layer of the group, all sized by the group's block count; cpllm/layers/cache_spec.py) and, per request,
its own block table, indexed like every other group's by the virtual block (`tokens_per_block` = block_size x the
ranks one request's KV is divided over). Which kind a model's layers are is the layer-kind registry's answer
(cpllm/layers/registry.py); this module names none.

A full group keeps every block. A windowed group keeps only the blocks its next queries can read: a query at
position q sees keys q - W < j <= q, so before a step whose first new token sits at position P every virtual
block wholly below P - W + 1 is dead on every rank (under the sharded layout a virtual block's positions are its
rank shares' positions: context_parallel.md, "KV layout"); the scheduler returns it to the group's pool and marks
its table entry FREED_BLOCK. Freed entries form a prefix of the table.

Both sides import this module: the scheduler (what to keep, how many blocks a request may hold) and the ranks
(which pool a layer reads, how to divide the KV memory among the groups).
"""

from __future__ import annotations

from dataclasses import dataclass

from cpllm.config.attention import layer_window
from cpllm.layers.cache_spec import CacheSpec
from cpllm.layers.registry import kind_of, layer_kind, state_layer_indices
from cpllm.step import FREED_BLOCK

__all__ = ["FREED_BLOCK", "KVGroupSpec", "kv_groups", "layer_groups", "group_cache_spec", "full_cache_spec", "first_key", "first_kept_block", "blocks_touched",
           "window_blocks", "max_chunk", "split_blocks", "group_block_needs", "length_capacity"]


@dataclass(frozen=True, slots=True)
class KVGroupSpec:
    """One KV cache group: the layers that share a block table."""

    window: int | None
    """Sliding window W of its layers (query position q sees keys q - W < j <= q); None: full attention."""
    layers: tuple[int, ...]
    """Indices of its decoder layers, ascending."""
    kind: str = "gqa"
    """The layer kind of its layers (cpllm/layers/registry.py), whose cache spec says what a slot holds."""

    def describe(self) -> str:
        what = "full attention" if self.window is None else f"sliding window {self.window}"
        kind = "" if self.kind == "gqa" else f"{self.kind} "  # the default kind unnamed, as the logs always read
        return f"{kind}{what} (layers {', '.join(map(str, self.layers))})"


def kv_groups(config, max_model_len: int) -> tuple[KVGroupSpec, ...]:
    """The groups of a ModelConfig's layers: the full-attention group first (if any), then one group per distinct
    window, ascending. A window no shorter than `max_model_len` (the configured longest request, as the model's
    layers are built with it) hides nothing, so its layers are full ones (config_attention.layer_window)."""
    by_window: dict[int | None, list[int]] = {}
    stateful = state_layer_indices(config)  # layers keeping a state per request hold no rows: no group
    for index in range(config.num_hidden_layers):
        if index in stateful:
            continue
        by_window.setdefault(layer_window(config, index, max_model_len), []).append(index)
    order = sorted(by_window, key=lambda w: -1 if w is None else w)
    kind = kind_of(config).name
    return tuple(KVGroupSpec(window=w, layers=tuple(by_window[w]), kind=kind) for w in order)


def full_cache_spec(config, kv_heads: int, element_bytes: int) -> CacheSpec:
    """The cache spec of one full-attention layer of `config`'s kind on a rank holding `kv_heads` KV heads (what
    the planner and the bench count per token)."""
    return layer_kind(kind_of(config).name).cache_spec(config, window=None, kv_heads=kv_heads,
                                                       element_bytes=element_bytes)


def group_cache_spec(group: KVGroupSpec, config, kv_heads: int, element_bytes: int) -> CacheSpec:
    """One layer's cache spec in `group` on a rank holding `kv_heads` KV heads, at `element_bytes` a value."""
    return layer_kind(group.kind).cache_spec(config, window=group.window, kv_heads=kv_heads,
                                             element_bytes=element_bytes)


def layer_groups(groups: tuple[KVGroupSpec, ...], num_layers: int | None = None) -> tuple[int, ...]:
    """Layer index -> its group's index in `groups`; a layer in no group (one keeping a state per request, of a
    model of `num_layers` layers) -> 0, whose step metadata it reads for its rows (never its block tables)."""
    owner = {layer: g for g, group in enumerate(groups) for layer in group.layers}
    return tuple(owner.get(i, 0) for i in range(len(owner) if num_layers is None else num_layers))


def first_key(window: int | None, query: int) -> int:
    """The first key position a query at position `query` reads: 0 for full attention, else query - W + 1 (or 0)."""
    return 0 if window is None else max(query - window + 1, 0)


def first_kept_block(window: int | None, first_query: int, tokens_per_block: int) -> int:
    """Index of the first virtual block a group still needs when its next query is at position `first_query`:
    0 for full attention, else the block of position first_query - W + 1 (every block before it lies wholly out
    of the window of that query and of every later one)."""
    return first_key(window, first_query) // tokens_per_block


def blocks_touched(first_pos: int, end_pos: int, tokens_per_block: int) -> int:
    """Virtual blocks holding positions [first_pos, end_pos)."""
    if end_pos <= first_pos:
        return 0
    return (end_pos - 1) // tokens_per_block - first_pos // tokens_per_block + 1


def window_blocks(window: int, tokens_per_block: int, new_tokens: int = 1) -> int:
    """Most blocks one request holds in a group of window W during a step of `new_tokens` new tokens: the keys
    of positions [P - W + 1, P + new_tokens), W - 1 + new_tokens positions, over at most
    ceil((W + new_tokens - 2) / V) + 1 blocks. For a decode step (and between steps) that is the window plus one
    block: W / V + 1 when V divides W."""
    span = window - 1 + new_tokens
    return -(-(span - 1) // tokens_per_block) + 1


def max_chunk(window: int | None, first_query: int, num_blocks: int, tokens_per_block: int) -> int:
    """Most new tokens a request at `first_query` can compute in one step with `num_blocks` blocks in a group:
    its blocks [first_kept_block, (first_query + n - 1) // V] must fit the group's pool."""
    first = first_kept_block(window, first_query, tokens_per_block)
    return (num_blocks + first) * tokens_per_block - first_query


def length_capacity(groups: tuple[KVGroupSpec, ...], group_blocks: tuple[int, ...],
                    tokens_per_block: int) -> int | None:
    """Longest request the pools can hold: what the smallest full-attention group's pool holds (a full group keeps
    every position); None when every layer slides (a windowed group keeps only a window, whatever the length)."""
    full = [n for group, n in zip(groups, group_blocks) if group.window is None]
    return min(full) * tokens_per_block if full else None


def group_block_needs(groups: tuple[KVGroupSpec, ...], tokens_per_block: int, max_num_seqs: int,
                      max_model_len: int, max_num_batched_tokens: int) -> tuple[int, ...]:
    """Blocks each group can ever hold at once: a full group max_num_seqs requests of max_model_len tokens; a
    windowed group each request's window plus a block, plus the step's new tokens (at most
    max_num_batched_tokens over all requests, each request's share starting a block of its own), never more
    than the full group's number."""
    full = max_num_seqs * -(-max_model_len // tokens_per_block)
    needs = []
    for group in groups:
        if group.window is None:
            needs.append(full)
            continue
        chunk = -(-min(max_num_batched_tokens, max_num_seqs * max_model_len) // tokens_per_block)
        needs.append(min(full, max_num_seqs * (window_blocks(group.window, tokens_per_block) + 1) + chunk))
    return tuple(needs)


def split_blocks(layer_counts: tuple[int, ...], needs: tuple[int | None, ...], layer_block_bytes: int,
                 budget_bytes: int) -> tuple[int, ...]:
    """Blocks per group from a byte budget: every group gets the same count (what full attention in every layer
    would give) unless it needs fewer; what a group does not need goes to the others, evenly by layer (water
    filling). `needs[g]` None: as many as the budget gives. A block of group g costs
    layer_counts[g] x layer_block_bytes."""
    counts = [0] * len(layer_counts)
    order = sorted(range(len(layer_counts)), key=lambda g: float("inf") if needs[g] is None else needs[g])
    left, layers_left = budget_bytes, sum(layer_counts)
    for position, g in enumerate(order):
        even = left // (layers_left * layer_block_bytes)
        if needs[g] is not None and needs[g] <= even:
            counts[g] = needs[g]
            left -= needs[g] * layer_counts[g] * layer_block_bytes
            layers_left -= layer_counts[g]
            continue
        for rest in order[position:]:
            counts[rest] = even if needs[rest] is None else min(even, needs[rest])
        break
    return tuple(counts)
