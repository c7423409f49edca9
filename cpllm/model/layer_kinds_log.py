"""The start-up log of the decoder layers' caches: one line per KV group (layers of one kind and window), with the
bytes one request of max_model_len tokens takes in each of its layers on this rank, from the kind's cache spec."""

from __future__ import annotations

import math

from cpllm.config.attention import SLIDING, layer_kind
from cpllm.kv_groups import group_cache_spec, kv_groups
from cpllm.layers.cache_spec import LATENT
from cpllm.layers.registry import state_layer_specs


def _ranges(indices: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8'."""
    parts, start = [], indices[0]
    for prev, cur in zip(indices, indices[1:] + [None]):
        if cur != prev + 1:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
            start = cur
    return ", ".join(parts)


def layer_kinds_lines(model) -> list[str]:
    """Lines for the load summary of a model whose layers hold `self_attn` with `attn` (PagedCPAttention, whose
    comm says over how many ranks a request's cache is divided) and, for a row cache, `num_kv_heads`. A windowed
    group's bytes are its window's: it frees what leaves the window (cpllm/kv_groups.py), so it holds at most the
    window and one block."""
    config, max_len = model.config, getattr(model, "max_positions", None)
    groups = kv_groups(config, max_len) if max_len is not None else ()
    attn = next(layer.self_attn for layer in model.layers if getattr(layer, "self_attn", None) is not None)
    kv_heads = getattr(attn, "num_kv_heads", 1)
    dtype = model.embed_tokens.dtype  # the pools' unless --kv-cache-dtype narrows them
    lines = ["attention layers:"]
    for group in groups:
        indices = list(group.layers)
        what = f"sliding window of {group.window} tokens" if group.window is not None else "full attention"
        if group.window is None and any(layer_kind(config, i) == SLIDING for i in indices):
            what += f" (window {config.sliding_window} >= max_model_len {max_len}: no position leaves it)"
        spec = group_cache_spec(group, config, kv_heads, dtype.itemsize)
        kept = spec.tokens_kept(max_len)  # this rank's share of the positions a request keeps
        per_layer = math.ceil(kept / attn.attn.kv.size) * spec.bytes_per_token
        cached = "latents" if spec.kind == LATENT else "K/V"
        held = "" if group.window is None else f" (its last {kept} positions, plus at most one block)"
        size = (f"; {cached} of one {max_len}-token request: {per_layer / 2**10:.1f} KiB per layer on this "
                f"rank{held} (at {str(dtype).removeprefix('torch.')})")
        lines.append(f"  layers {_ranges(indices)} ({len(indices)}): {what}{size}")
    states = state_layer_specs(config, getattr(model, "tp_size", 1))  # layers keeping a state per request
    for spec in {spec.describe(): spec for spec in states.values()}.values():
        indices = sorted(i for i, s in states.items() if s == spec)
        lines.append(f"  layers {_ranges(indices)} ({len(indices)}): {spec.describe()} per layer on this rank, "
                     "whatever the request's length")
    return lines
