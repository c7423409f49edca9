"""The MLA kind's cache (torch-free): one latent row per position, `kv_lora_rank + qk_rope_head_dim` values
shared by every head, in one pool read as both keys and values; replicated over TP, sharded over the KV-shard
group like any row cache."""

from __future__ import annotations

from cpllm.layers.cache_spec import LATENT, CacheSpec, PoolSpec


def latent_rows(config, *, window: int | None, kv_heads: int, element_bytes: int) -> CacheSpec:
    """One pool [slots, 1, latent_width] of one layer (no MLA family slides; `kv_heads` is 1)."""
    if window is not None:
        raise ValueError(f"a latent (MLA) layer with a sliding window ({window}) is not built")
    return CacheSpec(kind=LATENT, pools=(PoolSpec(name="latent", heads=1, width=config.mla.latent_width),),
                     element_bytes=element_bytes, shared_kv=True)


def serves(config) -> bool:
    """Models with multi-head latent attention (their config carries an MLAConfig)."""
    return getattr(config, "mla", None) is not None
