"""`CPLLM_INT4_GEMM_FROM_ROWS`: the row count from which the int4 layers run dequantized GEMMs, set by hand.

Read here without torch, so that the engine's configuration (EngineConfig) refuses a bad value before any rank
loads weights, and the kernels' choice (cpllm/kernels/int4_choice.py) replaces its measured threshold with it.
"""

from __future__ import annotations

import os

THRESHOLD_ENV = "CPLLM_INT4_GEMM_FROM_ROWS"
"""Replaces the measured threshold where set: a row count of 1 or more, or "never" (the integer kernel's rounding
at every count, at its speed). The GEMMs' dtype is still the measured one."""
NEVER = 1 << 62
"""A threshold no call reaches: the GEMMs never run (measured so, or asked for with "never")."""


def threshold_override() -> int | None:
    """The threshold THRESHOLD_ENV sets (NEVER for "never"), or None where it is unset or empty; a ValueError
    naming any other value."""
    value = os.environ.get(THRESHOLD_ENV, "").strip()
    if not value:
        return None
    if value == "never":
        return NEVER
    if value.isdigit() and int(value) >= 1:
        return int(value)
    raise ValueError(f"{THRESHOLD_ENV}={value!r}: a row count of 1 or more, or 'never'")
