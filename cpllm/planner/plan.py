"""`cpllm plan`: every valid TP x PCP x DCP layout of a cluster, its predicted TTFT, decode time per token, KV
capacity and memory per device, and the one to use.

The prefill strategy of each PCP layout is the one `--cp-prefill-strategy auto` would pick for the request
(strategy.py: the faster of cpllm's ring and pass-Q, and on a CPU host the all-gather, by this same cost model); its
TTFT is the cost model's for cpllm's implementation of that strategy. The recommendation: among layouts whose weights
and the request's KV fit, those meeting the TTFT objective (all of them without one), the fastest decode when an
objective is given, else the fastest TTFT.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from cpllm.config.engine import ModelConfig
from cpllm.distributed.parallel_dims import ParallelDims, valid_dcp_sizes
from cpllm.planner.cost_model import CostModel
from cpllm.planner.strategy import StepSizes, choose


@dataclass(kw_only=True, frozen=True, slots=True)
class PlanRequest:
    """The workload a layout is sized for."""

    context: int
    """Tokens of the request (prompt, cached part included)."""
    prefix_hit: float = 0.0
    """Share of the context already in the KV cache (multi-turn, shared prefixes)."""
    ttft_slo_s: float | None = None
    """Time-to-first-token objective; None: none."""
    batch: int = 1
    """Requests decoding together (for the decode time per token)."""

    def __post_init__(self) -> None:
        if self.context < 1:
            raise ValueError(f"context must be >= 1 token, got {self.context}")
        if not 0 <= self.prefix_hit < 1:
            raise ValueError(f"prefix_hit must be in [0, 1), got {self.prefix_hit}")
        if self.batch < 1:
            raise ValueError(f"batch must be >= 1, got {self.batch}")

    @property
    def cached(self) -> int:
        return int(self.context * self.prefix_hit)

    @property
    def new(self) -> int:
        return self.context - self.cached


@dataclass(kw_only=True, frozen=True, slots=True)
class LayoutPrediction:
    """What the cost model expects of one layout."""

    layout: ParallelDims
    strategy: str
    """Prefill strategy auto picks ("-" without PCP)."""
    ttft_s: float
    decode_s_per_token: float
    kv_capacity_tokens: int
    weights_per_device_bytes: float
    memory_per_device_bytes: float
    """Weights plus this request's KV shard (and its states, for a model with state layers)."""
    fits: bool
    meets_slo: bool

    def row(self) -> dict:
        return {
            "layout": self.layout.label(), "tp": self.layout.tp, "pcp": self.layout.pcp, "dcp": self.layout.dcp,
            "kv_layout": self.layout.kv_cache_layout, "strategy": self.strategy, "ttft_s": round(self.ttft_s, 4),
            "decode_ms_per_token": round(self.decode_s_per_token * 1e3, 3),
            "kv_capacity_tokens": self.kv_capacity_tokens,
            "weights_gib_per_device": round(self.weights_per_device_bytes / 2**30, 3),
            "memory_gib_per_device": round(self.memory_per_device_bytes / 2**30, 3),
            "fits": self.fits, "meets_slo": self.meets_slo,
        }


def valid_layouts(model: ModelConfig, devices: int) -> list[ParallelDims]:
    """Every TP x PCP = `devices` layout the engine accepts for `model`, each DCP size, both KV layouts."""
    layouts = []
    for tp in (t for t in range(1, devices + 1) if devices % t == 0):
        pcp = devices // tp
        try:
            ParallelDims(tp=tp, pcp=pcp).validate(model)
        except ValueError:
            continue
        for dcp in valid_dcp_sizes(tp, model.num_key_value_heads):
            for replicated in (False, True) if pcp > 1 else (False,):
                layouts.append(ParallelDims(tp=tp, pcp=pcp, dcp=dcp, kv_replicated=replicated))
    return layouts


def auto_strategy(cost: CostModel, layout: ParallelDims, request: PlanRequest) -> str:
    """What `--cp-prefill-strategy auto` runs for this request on this layout (the engine's own decision,
    strategy.choose, on this cost model)."""
    if layout.pcp == 1:
        return "-"
    if layout.kv_replicated:
        return "ring"
    return choose(cost, layout, StepSizes(new=request.new, cached=request.cached)).strategy


def predict(cost: CostModel, layout: ParallelDims, request: PlanRequest) -> LayoutPrediction:
    strategy = auto_strategy(cost, layout, request)
    ttft = cost.prefill(layout, request.new, request.cached, "ring" if strategy == "-" else strategy).total_s
    memory = cost.memory(layout)
    kv_shard = -(-request.context // layout.kv_shard_size) * memory.kv_bytes_per_token
    kv_shard += memory.state_bytes_per_request  # a hybrid's states: per request, whatever its length, on every rank
    fits = memory.fits_weights and request.context <= memory.kv_capacity_tokens
    return LayoutPrediction(
        layout=layout, strategy=strategy, ttft_s=ttft,
        decode_s_per_token=cost.decode_step(layout, request.context, request.batch),
        kv_capacity_tokens=memory.kv_capacity_tokens, weights_per_device_bytes=memory.weights_bytes,
        memory_per_device_bytes=memory.weights_bytes + kv_shard, fits=fits,
        meets_slo=request.ttft_slo_s is None or ttft <= request.ttft_slo_s,
    )


def plan(cost: CostModel, devices: int, request: PlanRequest) -> tuple[list[LayoutPrediction], LayoutPrediction | None]:
    """Predictions for every valid layout on `devices` devices, fastest TTFT first, and the recommended one."""
    predictions = sorted((predict(cost, layout, request) for layout in valid_layouts(cost.model, devices)),
                         key=lambda p: (p.ttft_s, p.decode_s_per_token))
    return predictions, recommend(predictions, request)


def recommend(predictions: list[LayoutPrediction], request: PlanRequest) -> LayoutPrediction | None:
    candidates = [p for p in predictions if p.fits and p.meets_slo]
    if not candidates:
        return None
    if request.ttft_slo_s is not None:
        return min(candidates, key=lambda p: (p.decode_s_per_token, p.ttft_s))
    return min(candidates, key=lambda p: (p.ttft_s, p.decode_s_per_token))


def fit_efficiency(cost: CostModel, layout: ParallelDims, tokens: int, measured_s: float,
                   strategy: str = "ring") -> float:
    """The compute efficiency that makes the model's prefill of `tokens` on `layout` take `measured_s`: the
    communication terms do not depend on it when nothing overlaps (one node, TP only), so it is closed form."""
    peak_hw = cost.hw.with_efficiency(1.0)
    at_peak = CostModel(cost.model, peak_hw, cost.precision).prefill(layout, tokens, 0, strategy)
    matmuls = CostModel(cost.model, dataclasses.replace(peak_hw, attention_row_traffic=False), cost.precision)
    compute = sum(getattr(matmuls.prefill(layout, tokens, 0, strategy), k) for k in ("linear_s", "attention_s"))
    rest = at_peak.total_s - compute  # the attention rows' memory traffic does not scale with the factor
    if measured_s <= rest:
        raise ValueError(f"measured {measured_s} s is not more than the predicted communication alone ({rest:.3g} s)")
    efficiency = compute / (measured_s - rest)
    if not 0 < efficiency <= 1:
        raise ValueError(f"fitted efficiency {efficiency:.3g} is outside (0, 1]: the measurement ({measured_s} s) is "
                         f"faster than the hardware's peak allows ({compute + rest:.3g} s)")
    return efficiency
