"""Rotary position embedding (rotate-half layout, as in Hugging Face Llama), with its scaling types.

Every family builds its tables here, from config.json's `rope_scaling` as ModelConfig resolved it
(cpllm/config/rope.py: the types, their checks and defaults):

- default: inv_freq[i] = theta ** (-2i / d);
- linear: every frequency divided by `factor` (positions interpolated);
- dynamic (NTK-aware): the base raised to theta * (factor * L / orig - (factor - 1)) ** (d / (d - 2)). transformers
  recomputes this for every forward with L = the current length (and unscaled frequencies up to orig), which a
  paged cache cannot follow: the keys already cached were rotated with the old frequencies. cpllm, like vLLM,
  fixes L = orig * factor, so it equals transformers on a sequence of exactly that length and differs (slightly)
  on every other length;
- yarn: frequencies blended between the original (fast, extrapolated) and divided by `factor` (slow,
  interpolated) over a ramp between the dimensions that turn beta_fast and beta_slow times over the original
  length (rounded outward when `truncate`, the default); cos and sin are multiplied by its attention factor;
- llama3: long wavelengths divided by `factor`, short ones kept, a smooth blend between.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from cpllm.config.rope import rope_attention_factor, rope_type, yarn_mscale

__all__ = ["RotaryEmbedding", "apply_rope", "rope_attention_factor", "rope_inv_freq", "rope_parameters",
           "yarn_mscale"]


def _plain_inv_freq(dim: int, base: float) -> torch.Tensor:
    """theta ** (-2i / dim) for i < dim / 2, float32 [dim // 2]."""
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _original_length(scaling: dict[str, Any]) -> float:
    if "original_max_position_embeddings" not in scaling:
        raise ValueError(f"rope_scaling {scaling!r} has no original_max_position_embeddings; build it through "
                         "ModelConfig (cpllm.config.rope.resolve_rope_scaling fills it in)")
    return scaling["original_max_position_embeddings"]


def _dynamic_inv_freq(dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    factor, orig = scaling["factor"], _original_length(scaling)
    length = orig * factor  # fixed: the length where transformers' per-forward form gives the same base
    base = theta * ((factor * length / orig) - (factor - 1)) ** (dim / (dim - 2))
    return _plain_inv_freq(dim, base)


def _yarn_correction_dim(rotations: float, dim: int, theta: float, orig: float) -> float:
    """The (fractional) dimension whose wavelength fits `rotations` times into the original length."""
    return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))


def _yarn_inv_freq(dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    factor, orig = scaling["factor"], _original_length(scaling)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1
    low = _yarn_correction_dim(beta_fast, dim, theta, orig)
    high = _yarn_correction_dim(beta_slow, dim, theta, orig)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a one-point ramp would divide by zero
    # 0 below `low` (keep the original frequency), 1 above `high` (interpolate), linear between
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # [dim // 2]
    extrapolated = _plain_inv_freq(dim, theta)
    interpolated = extrapolated / factor
    keep = 1 - ramp
    return interpolated * (1 - keep) + extrapolated * keep


def _llama3_inv_freq(dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    inv_freq = _plain_inv_freq(dim, theta)
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


_INV_FREQ = {
    "default": lambda dim, theta, scaling: _plain_inv_freq(dim, theta),
    "linear": lambda dim, theta, scaling: _plain_inv_freq(dim, theta) / scaling["factor"],
    "dynamic": _dynamic_inv_freq,
    "yarn": _yarn_inv_freq,
    "llama3": _llama3_inv_freq,
}


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies, float32 [head_dim // 2], with `scaling` applied (None: unscaled). `head_dim` is the
    rotated width (the part of a head that rotary turns); `scaling` as ModelConfig.rope_scaling holds it."""
    kind = rope_type(scaling)
    if kind not in _INV_FREQ:
        raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: {', '.join(_INV_FREQ)}")
    return _INV_FREQ[kind](head_dim, theta, scaling)


def rope_parameters(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim // 2], attention factor): what transformers' ROPE_INIT_FUNCTIONS return;
    the factor multiplies cos and sin (yarn's; 1 for the other types)."""
    return rope_inv_freq(head_dim, theta, scaling), rope_attention_factor(scaling)


class RotaryEmbedding(torch.nn.Module):
    """The cos/sin tables of every position up to `max_positions`, times the attention factor; `tables` picks a
    step's rows."""

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None, max_positions: int):
        super().__init__()
        # float32 products, as transformers computes them, so logits match it at long positions too
        inv_freq, attention_factor = rope_parameters(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq.float())
        # [max_positions, head_dim // 2]; multiplied in float32 before any cast, as transformers does
        self.register_buffer("cos", freqs.cos() * attention_factor, persistent=False)
        self.register_buffer("sin", freqs.sin() * attention_factor, persistent=False)

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
