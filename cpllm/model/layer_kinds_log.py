"""The start-up log of the decoder layers' attention kinds: one line per group of layers of one kind and window,
with the K/V bytes one request of max_model_len tokens takes in each of its layers on this rank."""

from __future__ import annotations

import math

from cpllm.config_attention import SLIDING, layer_kind


def _ranges(indices: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8'."""
    parts, start = [], indices[0]
    for prev, cur in zip(indices, indices[1:] + [None]):
        if cur != prev + 1:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
            start = cur
    return ", ".join(parts)


def layer_kinds_lines(model) -> list[str]:
    """Lines for the load summary of a model whose layers hold `self_attn` with `attn` (PagedCPAttention), for a
    windowed layer `window`, and (for the bytes) `num_kv_heads` and `head_dim`. A windowed layer's bytes are its window's: its KV group
    frees what leaves the window (cpllm/kv_groups.py), so it holds at most the window and one block."""
    config, max_len = model.config, getattr(model, "max_positions", None)
    groups: dict[tuple[str, int | None], list[int]] = {}
    for index, layer in enumerate(model.layers):
        window = getattr(layer.self_attn, "window", None)
        kind = SLIDING if window is not None else "full_attention"
        groups.setdefault((kind, window), []).append(index)
    attn = model.layers[0].self_attn
    # bytes of layers whose cache shape is known: K and V heads, or MLA's latent rows
    sized = max_len is not None and (hasattr(attn, "cache_values_per_token") or hasattr(attn, "num_kv_heads"))
    lines = ["attention layers:"]
    for (kind, window), indices in groups.items():
        what = f"sliding window of {window} tokens" if window is not None else "full attention"
        if window is None and any(layer_kind(config, i) == SLIDING for i in indices):
            what += f" (window {config.sliding_window} >= max_model_len {max_len}: no position leaves it)"
        size = ""
        if sized:
            # this rank's share of the positions a request keeps: all of them, or a windowed group's last W (its KV
            # group frees the blocks that leave the window; cpllm/kv_groups.py)
            kept = max_len if window is None else min(window, max_len)
            tokens = math.ceil(kept / attn.attn.comm.kv_size)
            dtype = model.embed_tokens.dtype  # the pools' unless --kv-cache-dtype narrows them
            # MLA caches one latent row (cache_values_per_token values) per token instead of K and V per head
            values = getattr(attn, "cache_values_per_token", None) or attn.num_kv_heads * attn.head_dim * 2
            per_layer = tokens * values * dtype.itemsize
            what_cached = "latents" if hasattr(attn, "cache_values_per_token") else "K/V"
            held = "" if window is None else f" (its last {kept} positions, plus at most one block)"
            size = (f"; {what_cached} of one {max_len}-token request: {per_layer / 2**10:.1f} KiB per layer on this "
                    f"rank{held} (at {str(dtype).removeprefix('torch.')})")
        lines.append(f"  layers {_ranges(indices)} ({len(indices)}): {what}{size}")
    return lines
