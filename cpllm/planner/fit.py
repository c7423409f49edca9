"""Fitting the two compute utilisations of a device on two measured prefills.

A prefill's time is  L / u_gemm + A / u_attention + rest,  with L and A the time the projections and the attention
kernel's matmuls would take at peak and `rest` everything else (collectives, what of the rings is exposed, the
attention rows' memory traffic). With two measurements of different attention shares that is two linear equations
in 1 / u_gemm and 1 / u_attention. `rest` depends a little on the utilisations (a slower attention hides more of a
ring), so the solve repeats with `rest` taken at the last answer until it settles.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from cpllm.distributed.parallel_dims import ParallelDims
from cpllm.planner.cost_model import CostModel

ITERATIONS = 50


@dataclass(kw_only=True, frozen=True, slots=True)
class Measured:
    """One measured prefill: a fresh prompt on one layout."""

    name: str
    layout: ParallelDims
    tokens: int
    seconds: float
    strategy: str = "ring"
    """The cost model's strategy for it ("ring" without PCP: it plays no part)."""


def _parts(cost: CostModel, point: Measured) -> tuple[float, float, float]:
    """(projections at peak, attention matmuls at peak, the rest at the spec's utilisations) in seconds."""
    hw = cost.hw
    at_peak = dataclasses.replace(hw, efficiency=1.0, gemm_utilization=1.0, attention_utilization=1.0,
                                  attention_row_traffic=False, attention_row_overhead=0.0)
    peak = CostModel(cost.model, at_peak, cost.precision).prefill(point.layout, point.tokens, 0, point.strategy)
    now = cost.prefill(point.layout, point.tokens, 0, point.strategy)
    linear = peak.linear_s
    attention = peak.attention_s
    rest = now.total_s - now.linear_s - attention / (hw.attention_utilization * hw.efficiency)
    return linear, attention, rest


def fit_utilizations(cost: CostModel, first: Measured, second: Measured) -> tuple[float, float]:
    """(gemm_utilization, attention_utilization) that make the cost model give both measured times."""
    hw = cost.hw.with_utilizations(1.0, 1.0, "")
    for _ in range(ITERATIONS):
        current = CostModel(cost.model, hw, cost.precision)
        (l1, a1, r1), (l2, a2, r2) = _parts(current, first), _parts(current, second)
        y1, y2 = first.seconds - r1, second.seconds - r2
        det = l1 * a2 - l2 * a1
        if abs(det) < 1e-9 * abs(l1 * a2):
            raise ValueError(f"{first.name} and {second.name} have the same attention share: they cannot separate "
                             "the two utilisations")
        inv_gemm, inv_attention = (y1 * a2 - y2 * a1) / det, (l1 * y2 - l2 * y1) / det
        if inv_gemm < 1 or inv_attention < 1:
            raise ValueError(f"fit on {first.name} and {second.name} gives utilisations outside (0, 1] (GEMM "
                             f"{1 / inv_gemm:.3g}, attention {1 / inv_attention:.3g}): the model cannot give "
                             "both times")
        hw = hw.with_utilizations(1 / inv_gemm, 1 / inv_attention, "")
    return hw.gemm_utilization, hw.attention_utilization
