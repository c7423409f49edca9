"""The planner's predictions of the paper's Table 7 (published.py), with the one efficiency factor fitted on CP1.

Used by tests/test_planner.py (which asserts the errors) and by the benchmark page's plot (benchmarks/report_cp.py).
"""

from __future__ import annotations

from cpllm.distributed.parallel_dims import ParallelDims
from cpllm.planner.cost_model import CostModel, Precision
from cpllm.planner.hardware import builtin_hardware
from cpllm.planner.models import load_model_shape
from cpllm.planner.plan import PlanRequest, fit_efficiency, plan
from cpllm.planner.published import GPU, MODEL, TABLE7, TABLE7_NAMES, TABLE7_TOKENS

FP8 = Precision(weight_format="fp8", activation_bytes=2, kv_bytes=2)
"""The paper's run: FP8 weights, BF16 activations and KV."""


def paper_cost(efficiency: float = 1.0) -> CostModel:
    return CostModel(load_model_shape(MODEL), builtin_hardware(GPU).with_efficiency(efficiency), FP8)


def fitted_efficiency() -> float:
    """The one factor, from the CP1 point alone (one node: TP8, nothing to overlap)."""
    return fit_efficiency(paper_cost(), ParallelDims(tp=8, pcp=1), TABLE7_TOKENS, TABLE7[(1, "8x1x1")])


def table7_predictions() -> list[dict]:
    """One row per published point: name, nodes, layout, strategy auto picks, published and predicted TTFT."""
    efficiency = fitted_efficiency()
    cost, rows = paper_cost(efficiency), []
    for (nodes, label), published in TABLE7.items():
        predictions, _ = plan(cost, nodes * 8, PlanRequest(context=TABLE7_TOKENS))
        row = next(p for p in predictions if p.layout.label() == label)
        rows.append({"name": TABLE7_NAMES[label], "nodes": nodes, "layout": label, "strategy": row.strategy,
                     "published_s": published, "predicted_s": round(row.ttft_s, 3),
                     "error": round((row.ttft_s - published) / published, 4), "efficiency": round(efficiency, 4)})
    return rows
