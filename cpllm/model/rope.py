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
    """The cos/sin tables of every position up to `max_positions`; `tables` picks a step's rows."""

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None, max_positions: int):
        super().__init__()
        # float32 products, as transformers computes them, so logits match it at long positions too
        inv_freq = rope_inv_freq(head_dim, theta, scaling).float()
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        # [max_positions, head_dim // 2]
        self.register_buffer("cos", freqs.cos().float(), persistent=False)
        self.register_buffer("sin", freqs.sin().float(), persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's rotation tables, looked up once per step and shared by every layer: cos [N, 1, D] = (cos, cos),
        sin [N, 1, D] = (-sin, sin), for x * cos + swap_halves(x) * sin."""
        cos = self.cos.index_select(0, positions).unsqueeze(1).to(dtype)  # [N, 1, D / 2]
        sin = self.sin.index_select(0, positions).unsqueeze(1).to(dtype)
        return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


def apply_rope(tables: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, num_heads, head_dim] rotated with the step's `tables` (RotaryEmbedding.tables).

    (x1 cos - x2 sin, x2 cos + x1 sin), rounded as transformers rounds it (negating sin is exact).
    """
    cos, sin = tables
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((x2, x1), dim=-1) * sin
