"""The gated DeltaNet kind's cache (torch-free): a state per request and per layer, whatever the request's length:
the causal convolution's window (its last conv_kernel - 1 inputs of q|k|v) and one delta-rule matrix
[key_head_dim, value_head_dim] per value head, for the heads this rank holds (heads split over TP). Held in float32:
the matrix accumulates every token's update."""

from __future__ import annotations

from cpllm.layers.cache_spec import STATE, CacheSpec, PoolSpec

STATE_ELEMENT_BYTES = 4
"""States are float32 whatever the model dtype."""

Runs = tuple[tuple[int, int], ...]
"""[start, end) runs of a pool's global rows, in the order the rank holds them."""


def serves(config) -> bool:
    """Never a whole model's kind: it claims only its layers (`state_layers`); the full layers stay GQA."""
    return False


def state_layers(config) -> tuple[int, ...]:
    """The gated DeltaNet layers of a hybrid (ModelConfig.linear_attention), () for any other model."""
    linear = getattr(config, "linear_attention", None)
    return () if linear is None else linear.linear_layers


def state_spec(config, *, tp_size: int) -> CacheSpec:
    """Pools of one request's state on one rank: `conv` [conv channels of this rank, conv_kernel - 1] and
    `delta` [value heads of this rank, key_head_dim x value_head_dim]."""
    linear = config.linear_attention
    if linear.num_key_heads % tp_size:
        raise ValueError(f"tensor_parallel_size={tp_size} must divide linear_num_key_heads={linear.num_key_heads}")
    return CacheSpec(kind=STATE, element_bytes=STATE_ELEMENT_BYTES, pools=(
        PoolSpec(name="conv", heads=linear.conv_dim // tp_size, width=linear.conv_kernel - 1),
        PoolSpec(name="delta", heads=linear.num_value_heads // tp_size,
                 width=linear.key_head_dim * linear.value_head_dim)))


def state_rows(config, *, tp_size: int, tp_rank: int) -> tuple[Runs, ...]:
    """For each pool of `state_spec`, the layer's global rows TP rank `tp_rank` holds, in its local order (what a
    transfer between TP layouts maps): `conv` its key heads' q channels, the same heads' k channels (key_dim on)
    and its value heads' v channels (2 key_dim on), as GatedDeltaNet.load cuts the convolution; `delta` its value
    heads. Adjacent runs are joined (one run on a single rank)."""
    linear = config.linear_attention
    check_tp_rank(tp_size, tp_rank)
    state_spec(config, tp_size=tp_size)  # refuses a TP size that splits a key head
    dk, dv, key_dim = linear.key_head_dim, linear.value_head_dim, linear.key_dim
    hk, hv = linear.num_key_heads // tp_size, linear.num_value_heads // tp_size
    k0, v0 = tp_rank * hk, tp_rank * hv
    conv = ((k0 * dk, (k0 + hk) * dk), (key_dim + k0 * dk, key_dim + (k0 + hk) * dk),
            (2 * key_dim + v0 * dv, 2 * key_dim + (v0 + hv) * dv))
    return joined(conv), ((v0, v0 + hv),)


def check_tp_rank(tp_size: int, tp_rank: int) -> None:
    """Refuse a TP size below 1 or a TP rank outside its group, naming both."""
    if not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tp_size!r}")
    if not isinstance(tp_rank, int) or not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank={tp_rank!r} is outside a TP group of tensor_parallel_size={tp_size}")


def joined(runs: Runs) -> Runs:
    """`runs` with each run that starts where the previous one ends merged into it (order kept)."""
    out: list[tuple[int, int]] = []
    for start, end in runs:
        if out and out[-1][1] == start:
            out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return tuple(out)


def row_spec(config, *, window: int | None, kv_heads: int, element_bytes: int) -> CacheSpec:
    """A state kind caches no rows: asking for them is a bug in the caller."""
    raise ValueError("gated DeltaNet layers cache a state per request, not rows per position (use state_spec)")
