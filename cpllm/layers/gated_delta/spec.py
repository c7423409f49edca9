"""The gated DeltaNet kind's cache (torch-free): a state per request and per layer, whatever the request's length:
the causal convolution's window (its last conv_kernel - 1 inputs of q|k|v) and one delta-rule matrix
[key_head_dim, value_head_dim] per value head, for the heads this rank holds (heads split over TP). Held in float32:
the matrix accumulates every token's update."""

from __future__ import annotations

from cpllm.layers.cache_spec import STATE, CacheSpec, PoolSpec

STATE_ELEMENT_BYTES = 4
"""States are float32 whatever the model dtype."""


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


def row_spec(config, *, window: int | None, kv_heads: int, element_bytes: int) -> CacheSpec:
    """A state kind caches no rows: asking for them is a bug in the caller."""
    raise ValueError("gated DeltaNet layers cache a state per request, not rows per position (use state_spec)")
