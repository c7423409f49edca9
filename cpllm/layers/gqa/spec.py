"""The GQA kind's cache (torch-free): a K and a V row of this rank's KV heads per position; a sliding layer keeps
only its window's positions (cpllm/kv_groups.py frees the blocks that leave it)."""

from __future__ import annotations

from cpllm.layers.cache_spec import FULL, SLIDING, CacheSpec, PoolSpec


def kv_rows(config, *, window: int | None, kv_heads: int, element_bytes: int) -> CacheSpec:
    """K and V pools [slots, kv_heads, head_dim] of one layer."""
    pools = (PoolSpec(name="k", heads=kv_heads, width=config.head_dim),
             PoolSpec(name="v", heads=kv_heads, width=config.head_dim))
    return CacheSpec(kind=FULL if window is None else SLIDING, pools=pools, element_bytes=element_bytes,
                     window=window)


def serves(config) -> bool:
    """Every model whose layers no other kind claims (the registry asks GQA last)."""
    return True
