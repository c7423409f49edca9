"""The sparse-MLA kind's cache (torch-free): per position, the MLA latent row (`kv_lora_rank + qk_rope_head_dim`
values, cpllm/layers/mla/spec.py) and the indexer's key (`index_head_dim` values), two pools on the same slots, so
on the same ownership rule (replicated over TP, sharded over the KV-shard group like any row cache)."""

from __future__ import annotations

from cpllm.layers.cache_spec import LATENT, CacheSpec, PoolSpec


def latent_and_index_rows(config, *, window: int | None, kv_heads: int, element_bytes: int) -> CacheSpec:
    """Two pools of one layer: latent [slots, 1, latent_width] and index [slots, 1, index_head_dim]; the layer's
    cache is (latent pool, index pool). Both are stored at the KV cache dtype (`element_bytes`)."""
    if window is not None:
        raise ValueError(f"a sparse-MLA layer with a sliding window ({window}) is not built")
    pools = (PoolSpec(name="latent", heads=1, width=config.mla.latent_width),
             PoolSpec(name="index", heads=1, width=config.indexer.index_head_dim))
    return CacheSpec(kind=LATENT, pools=pools, element_bytes=element_bytes)


def serves(config) -> bool:
    """MLA models with a lightning indexer (DeepSeek-V3.2, GLM-5: their config carries an IndexerConfig)."""
    return getattr(config, "mla", None) is not None and getattr(config, "indexer", None) is not None
