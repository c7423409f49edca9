"""The Kimi delta attention kind's cache (torch-free): a state per request and per layer, whatever the request's
length: the causal convolution's window (its last conv_kernel - 1 inputs of q|k|v) and one delta-rule matrix
[head_dim, head_dim] per head, for the heads this rank holds (heads split over TP). Float32, as the gated DeltaNet
kind's (the matrix accumulates every token's update); the pools have the same names and shapes, so every
state-kind path (allocation, budget, capacity log, planner) reads them alike."""

from __future__ import annotations

from cpllm.layers.cache_spec import STATE, CacheSpec, PoolSpec
from cpllm.layers.gated_delta.spec import STATE_ELEMENT_BYTES, Runs, check_tp_rank, joined


def serves(config) -> bool:
    """Never a whole model's kind: it claims only its layers (`state_layers`); the full layers stay MLA."""
    return False


def state_layers(config) -> tuple[int, ...]:
    """The KDA layers of a Kimi Linear model (ModelConfig.kimi_delta), () for any other model."""
    kda = getattr(config, "kimi_delta", None)
    return () if kda is None else kda.linear_layers


def state_spec(config, *, tp_size: int) -> CacheSpec:
    """Pools of one request's state on one rank: `conv` [conv channels of this rank, conv_kernel - 1] and
    `delta` [heads of this rank, head_dim x head_dim]."""
    kda = config.kimi_delta
    if kda.num_heads % tp_size:
        raise ValueError(f"tensor_parallel_size={tp_size} must divide linear_num_heads={kda.num_heads}")
    return CacheSpec(kind=STATE, element_bytes=STATE_ELEMENT_BYTES, pools=(
        PoolSpec(name="conv", heads=kda.conv_dim // tp_size, width=kda.conv_kernel - 1),
        PoolSpec(name="delta", heads=kda.num_heads // tp_size, width=kda.head_dim * kda.head_dim)))


def state_rows(config, *, tp_size: int, tp_rank: int) -> tuple[Runs, ...]:
    """For each pool of `state_spec`, the layer's global rows TP rank `tp_rank` holds, in its local order: `conv`
    its heads' rows of q, then of k (H d on), then of v (2 H d on), as KimiDeltaAttention.load concatenates the
    three convolutions; `delta` its heads. Adjacent runs are joined (one run on a single rank)."""
    kda = config.kimi_delta
    check_tp_rank(tp_size, tp_rank)
    state_spec(config, tp_size=tp_size)  # refuses a TP size that splits the heads unevenly
    heads, width = kda.num_heads // tp_size, kda.qkv_dim
    h0, d = tp_rank * heads, kda.head_dim
    conv = tuple((part * width + h0 * d, part * width + (h0 + heads) * d) for part in range(3))
    return joined(conv), ((h0, h0 + heads),)


def row_spec(config, *, window: int | None, kv_heads: int, element_bytes: int) -> CacheSpec:
    """A state kind caches no rows: asking for them is a bug in the caller."""
    raise ValueError("Kimi delta attention layers cache a state per request, not rows per position (use state_spec)")
