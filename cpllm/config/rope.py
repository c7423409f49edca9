"""Rotary scaling settings: validated at configuration time, with the defaults transformers fills in (no torch).

The tables themselves are built in cpllm/model/rope.py; this module only checks a config.json `rope_scaling`
dict, completes it, and derives the scalars (attention factor, usable context) that need no tensors.
"""

from __future__ import annotations

import math
from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")
"""rope_type values cpllm builds tables for; any other is refused when the ModelConfig is built."""


def rope_type(scaling: dict[str, Any] | None) -> str:
    """The dict's rope type (older configs spell the key `type`); no dict, or no key, is "default"."""
    if scaling is None:
        return "default"
    return scaling.get("rope_type", scaling.get("type")) or "default"


def _check_number(kind: str, key: str, value: Any, minimum: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= minimum:
        raise ValueError(f"rope_scaling type {kind!r}: {key}={value!r} must be a number >= {minimum}")


def resolve_rope_scaling(scaling: dict[str, Any] | None, max_position_embeddings: int) -> dict[str, Any] | None:
    """A checked copy of `scaling` with `rope_type` set and the fields each type reads filled in.

    yarn: `original_max_position_embeddings` defaults to `max_position_embeddings` and a missing `factor` to
    their ratio (as transformers does). dynamic: the original length is always `max_position_embeddings`,
    which is what transformers and vLLM read for this type (a dict's own value is ignored by both).
    Raises ValueError naming the type when it is not one of SUPPORTED_ROPE_TYPES, or naming a bad field.
    """
    if scaling is None:
        return None
    kind = rope_type(scaling)
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    out = {**scaling, "rope_type": kind}
    if kind == "default":
        return out
    if kind == "dynamic":
        out["original_max_position_embeddings"] = max_position_embeddings
    if kind == "yarn":
        out.setdefault("original_max_position_embeddings", max_position_embeddings)
    if kind in ("yarn", "llama3") and "original_max_position_embeddings" in out:
        _check_number(kind, "original_max_position_embeddings", out["original_max_position_embeddings"], 1)
    if kind == "yarn" and out.get("factor") is None:
        out["factor"] = max_position_embeddings / out["original_max_position_embeddings"]
    _check_number(kind, "factor", out.get("factor"), 1.0)
    return out


def rope_context_length(scaling: dict[str, Any] | None, max_position_embeddings: int) -> int:
    """The longest context the scaled rotary is meant for (vLLM's rule): linear and dynamic stretch
    `max_position_embeddings` by `factor`, yarn stretches its original length by `factor`; the others keep
    `max_position_embeddings`. `scaling` as resolve_rope_scaling returns it."""
    kind = rope_type(scaling)
    if kind in ("linear", "dynamic"):
        return int(max_position_embeddings * scaling["factor"])
    if kind == "yarn":
        return max(max_position_embeddings, int(scaling["original_max_position_embeddings"] * scaling["factor"]))
    return max_position_embeddings


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(scale) + 1 for a context stretched `scale` times (1 when not
    stretched). DeepSeek's MLA also multiplies its softmax scale by yarn_mscale(factor, mscale_all_dim) ** 2."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """What the cos and sin tables are multiplied by: yarn's attention factor (the dict's `attention_factor`;
    else DeepSeek's ratio yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim) when both are set
    and non-zero; else yarn_mscale(factor)); 1 for every other type. `scaling` as resolve_rope_scaling returns it."""
    if rope_type(scaling) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, mscale, mscale_all_dim = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)
