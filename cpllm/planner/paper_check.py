"""The planner's predictions of every published point (published.py), with the H100's two utilisations fitted on
FIT_POINTS and everything else predicted.

Other engines' points (published.OTHER_ENGINES) are predicted the same way on their own model and device.

Used by tests/test_planner.py (which asserts the errors), docs/context_parallel.md's table and the benchmark page's
plot (benchmarks/report_cp.py).
"""

from __future__ import annotations

import dataclasses

from cpllm.distributed.parallel_dims import ParallelDims
from cpllm.planner.cost_model import CostModel, Precision
from cpllm.planner.fit import Measured, fit_utilizations
from cpllm.planner.hardware import FITTED_ON, HardwareSpec, builtin_hardware
from cpllm.planner.models import load_model_shape
from cpllm.planner.plan import PlanRequest, fit_efficiency, plan
from cpllm.planner.published import FIT_POINTS, FRESH, GPU, MODEL, OTHER_ENGINES, PARTIAL, Point

FP8 = Precision(weight_format="fp8", activation_bytes=2, kv_bytes=2)
"""The paper's run: FP8 weights, BF16 activations and KV."""


def parse_layout(label: str) -> ParallelDims:
    tp, pcp, dcp = (int(x) for x in label.split("x"))
    return ParallelDims(tp=tp, pcp=pcp, dcp=dcp)


def measured(point: Point) -> Measured:
    return Measured(name=point.name, layout=parse_layout(point.layout), tokens=point.tokens, seconds=point.seconds,
                    strategy=point.strategy)


def paper_cost(hw: HardwareSpec | None = None) -> CostModel:
    """The paper's model and precision on `hw` (default: the built-in H100, its fitted utilisations)."""
    return CostModel(load_model_shape(MODEL), hw if hw is not None else builtin_hardware(GPU), FP8)


def fitted_utilizations() -> tuple[float, float]:
    """(GEMM, attention) utilisations fitted on the two FIT_POINTS from the H100's published peaks."""
    first, second = (measured(next(p for p in FRESH if p.name == name)) for name in FIT_POINTS)
    return fit_utilizations(paper_cost(), first, second)


def fitted_cost() -> CostModel:
    gemm, attention = fitted_utilizations()
    return paper_cost(builtin_hardware(GPU).with_utilizations(gemm, attention, FITTED_ON))


def one_factor_cost() -> CostModel:
    """The model before issue 30: one efficiency for both kinds of compute, fitted on CP1 alone."""
    cp1 = next(p for p in FRESH if p.name == "CP1")
    before = dataclasses.replace(builtin_hardware(GPU), attention_row_traffic=False)  # the term came with the rates
    factor = fit_efficiency(paper_cost(before), parse_layout(cp1.layout), cp1.tokens, cp1.seconds)
    return paper_cost(before.with_efficiency(factor))


def predict_point(cost: CostModel, point: Point) -> float:
    """Predicted seconds: a fresh prompt as `cpllm plan` shows it (auto's strategy), a partial prefill under the
    strategy the paper measured."""
    if point.cached:
        return cost.prefill(parse_layout(point.layout), point.tokens, point.cached, point.strategy).total_s
    devices = point.devices or point.nodes * cost.hw.devices_per_node
    predictions, _ = plan(cost, devices, PlanRequest(context=point.tokens))
    return next(p for p in predictions if p.layout.label() == point.layout and not p.layout.kv_replicated).ttft_s


def _row(cost: CostModel, point: Point) -> dict:
    predicted = predict_point(cost, point)
    return {"name": point.name, "nodes": point.nodes, "layout": point.layout, "tokens": point.tokens,
            "cached": point.cached, "published_s": point.seconds, "predicted_s": round(predicted, 3),
            "error": round((predicted - point.seconds) / point.seconds, 4),
            "fitted": point.name in FIT_POINTS, "source": point.source}


def published_predictions(cost: CostModel | None = None) -> list[dict]:
    """One row per published point of the paper: name, source, layout, published and predicted seconds, error,
    fitted or not."""
    cost = cost if cost is not None else fitted_cost()
    return [_row(cost, point) for point in FRESH + PARTIAL]


def engine_cost(point: Point) -> CostModel:
    """The cost model of another engine's point: its model and device as built in (the device's utilisations
    are the H100's, carried over), its weight format, 16-bit activations and KV."""
    precision = Precision(weight_format=point.weights, activation_bytes=2, kv_bytes=2)
    return CostModel(load_model_shape(point.model), builtin_hardware(point.gpu), precision)


def other_engine_predictions() -> list[dict]:
    """One row per other engine's published point (published.OTHER_ENGINES), predicted as the paper's are."""
    return [_row(engine_cost(point), point) for point in OTHER_ENGINES]


def model_utilization(cost: CostModel, point: Point) -> float:
    """The model's FLOPS utilisation of a fresh prefill: its FLOPs (projections, causal attention) over its devices'
    16-bit peak for the predicted time."""
    flops = cost.linear_flops(point.tokens) + cost.attention_flops(point.tokens, 0)
    devices = point.nodes * cost.hw.devices_per_node
    return flops / (predict_point(cost, point) * devices * cost.hw.peak_flops)
