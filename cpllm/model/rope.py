"""Rotary position embedding (rotate-half layout, as in Hugging Face Llama)."""

from __future__ import annotations

import math
from typing import Any

import torch


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2], with llama3 scaling applied when configured."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    rope_type = None if scaling is None else scaling.get("rope_type", scaling.get("type"))
    if rope_type != "llama3":
        return inv_freq
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_context = scaling.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are stretched by `factor`, short ones kept, the band between is blended.
    scaled = torch.where(wavelen > old_context / low_freq_factor, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = (wavelen >= old_context / high_freq_factor) & (wavelen <= old_context / low_freq_factor)
    return torch.where(in_band, blended, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Applies rotary embedding to q and k at their absolute positions."""

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None, max_positions: int):
        super().__init__()
        # float32 products, as transformers computes them, so logits match it at long positions too
        inv_freq = rope_inv_freq(head_dim, theta, scaling).float()
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        # [max_positions, head_dim // 2]
        self.register_buffer("cos", freqs.cos().float(), persistent=False)
        self.register_buffer("sin", freqs.sin().float(), persistent=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # positions [num_tokens]; x [num_tokens, num_heads, head_dim]
        cos = self.cos[positions].unsqueeze(1).to(x.dtype)  # [num_tokens, 1, head_dim // 2]
        sin = self.sin[positions].unsqueeze(1).to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
