"""The layer kinds and their backends (torch-free until a backend is asked for).

Adding a kind is its package and one entry in `LAYER_KINDS` (docs/architecture.md, "Adding a layer kind")."""

from __future__ import annotations

import importlib

from cpllm.layers import gated_delta, gqa, gqa_triton, kimi_delta, mla, sparse_mla
from cpllm.layers.kind import LayerKind

LAYER_KINDS: tuple[LayerKind, ...] = (
    gated_delta.KIND,  # a state kind: claims only its own layers (state_layers), never a whole model
    kimi_delta.KIND,  # the same: its layers of Kimi Linear (the others MLA)
    sparse_mla.KIND,  # before MLA, which would serve these models too
    mla.KIND,
    gqa.KIND,  # last: serves every model no kind before it claims
)
"""Every kind, asked in this order which one serves a model."""

BACKENDS: dict = {name: path for kind in LAYER_KINDS for name, path in kind.backends.items()}
BACKENDS.update(gqa_triton.BACKENDS)
"""Backend name -> "module:Class" (imported on first use), or a factory (a test's stand-in kind)."""

GRAPH_CAPTURABLE: frozenset[str] = frozenset(gqa_triton.GRAPH_CAPTURABLE)
"""Backends whose decode steps CUDA graphs can capture (cpllm/model/execution/cuda_graphs.py)."""


def kind_of(config) -> LayerKind:
    """The kind of a ModelConfig's attention layers."""
    for kind in LAYER_KINDS:
        if kind.serves(config):
            return kind
    raise ValueError(f"no layer kind serves architecture {getattr(config, 'architecture', '?')!r}")


def state_layer_specs(config, tp_size: int) -> dict:
    """Layer index -> the CacheSpec of its per-request state on a rank of a TP group of `tp_size`, for every layer
    a state kind claims (empty for a model of row caches only)."""
    specs = {}
    for kind in LAYER_KINDS:
        if kind.state_layers is not None:
            for index in kind.state_layers(config):
                specs[index] = kind.state_spec(config, tp_size=tp_size)
    return specs


def state_layer_rows(config, tp_size: int, tp_rank: int) -> dict:
    """Layer index -> its state pools' global rows on TP rank `tp_rank` of a TP group of `tp_size` (the kind's
    `state_rows`), for every layer a state kind claims (empty for a model of row caches only)."""
    rows = {}
    for kind in LAYER_KINDS:
        if kind.state_layers is None or not kind.state_layers(config):
            continue
        if kind.state_rows is None:
            raise ValueError(f"layer kind {kind.name!r} keeps states but gives no state_rows: its states cannot "
                             "move between parallel layouts")
        for index in kind.state_layers(config):
            rows[index] = kind.state_rows(config, tp_size=tp_size, tp_rank=tp_rank)
    return rows


def state_layer_indices(config) -> frozenset[int]:
    """The layers that keep a per-request state (no KV rows)."""
    return frozenset(i for kind in LAYER_KINDS if kind.state_layers is not None for i in kind.state_layers(config))


def layer_kind(name: str) -> LayerKind:
    """The kind registered as `name`."""
    for kind in LAYER_KINDS:
        if kind.name == name:
            return kind
    raise ValueError(f"no layer kind {name!r} (known: {', '.join(k.name for k in LAYER_KINDS)})")


def attention_backend(name: str = "gqa"):
    """A new instance of the backend registered as `name` (its module imported on first use)."""
    try:
        target = BACKENDS[name]
    except KeyError:
        raise ValueError(f"no attention backend {name!r} (known: {', '.join(sorted(BACKENDS))})") from None
    if callable(target):
        return target()
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)()
