"""The record a layer kind registers (torch-free): cpllm/layers/registry.py lists one per kind."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from cpllm.layers.cache_spec import CacheSpec


@dataclass(kw_only=True, frozen=True, slots=True)
class LayerKind:
    """One kind of attention layer: what it serves, what it caches, which backends run it."""

    name: str
    """The kind's key (also its default backend's name)."""
    serves: Callable[[Any], bool]
    """Whether a ModelConfig's layers are of this kind (the registry asks the kinds in order; the last serves
    every model)."""
    cache_spec: Callable[..., CacheSpec]
    """(model_config, *, window, kv_heads, element_bytes) -> one layer's CacheSpec on a rank holding `kv_heads`
    KV heads (window: the layer's sliding window or None)."""
    state_layers: Callable[[Any], tuple[int, ...]] | None = None
    """A state kind: model_config -> the layers that are this kind's and keep a fixed-size state per request
    (they join no KV group and read their state by the request's state slot); None: a row-cache kind."""
    state_spec: Callable[..., CacheSpec] | None = None
    """A state kind: (model_config, *, tp_size) -> one state layer's CacheSpec (kind STATE) on a rank of a TP
    group of `tp_size`."""
    state_rows: Callable[..., tuple] | None = None
    """A state kind: (model_config, *, tp_size, tp_rank) -> for each pool of `state_spec`, in order, the global
    rows of the whole layer (conv channels, value heads) that TP rank `tp_rank` holds, as [start, end) runs in the
    rank's local order, their lengths summing to the pool's `heads`: what moves a state between TP layouts
    (cpllm/disagg/state_plan.py). None: the kind's states cannot change layout."""
    backends: dict[str, str] = field(default_factory=dict)
    """Backend name -> "module:Class" of an `AttentionBackend` for this kind's pools, imported on first use (so the
    registry itself imports no torch)."""
