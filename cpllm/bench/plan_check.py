"""`cpllm bench plan`: `cpllm plan --calibrate`'s predicted TTFT against this machine's measured prefills.

Each repeat calibrates the machine (planner/calibrate.py: matmul and attention rates of one thread, gloo
point-to-point), then times a fresh prompt of every length on one rank with one thread and on PCP=2 with one
thread per rank and `--cp-prefill-strategy auto`, recording the strategies auto ran. Repeats loop outermost, so
load drifts hit every point alike. Each repeat's calibration predicts that repeat's prefills (the cost model's
time for the layout and the strategy auto picks); a point's error is the median of its per-repeat errors, and
both sides are also reported as medians and fastest repeats. Calibrating right before measuring, with median
rates, lets the comparison hold on a machine whose load is steady; it cannot hold through a load that changes
within a repeat.

The same runs give the PCP=2 parallel efficiency, TTFT(1 rank) / (2 x TTFT(PCP=2)).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from typing import Any

from cpllm.bench.common import BenchLayout, random_prompt
from cpllm.distributed.parallel_dims import ParallelDims
from cpllm.bench.engines import build_llm, model_config_of
from cpllm.bench.prefill import WARMUP_TOKENS, time_prefill
from cpllm.planner.cost_model import CostModel, Precision
from cpllm.planner.hardware import HardwareSpec
from cpllm.planner.plan import PlanRequest, auto_strategy

LAYOUTS = (BenchLayout.of(tp=1, pcp=1, threads_per_rank=1), BenchLayout.of(tp=1, pcp=2, threads_per_rank=1))
FP32 = Precision(weight_format="fp32", activation_bytes=4, kv_bytes=4)


def predict(config, hw: HardwareSpec, pcp: int, tokens: int) -> tuple[str, float]:
    """(strategy auto picks, predicted TTFT) of a fresh `tokens` prompt on PCP=`pcp` with one thread per rank."""
    cost, layout = CostModel(config, hw, FP32), ParallelDims(tp=1, pcp=pcp)
    strategy = auto_strategy(cost, layout, PlanRequest(context=tokens))
    return strategy, cost.prefill(layout, tokens, 0, "ring" if strategy == "-" else strategy).total_s


def _measure_layout(model, layout: BenchLayout, lengths: list[int], repeat: int, config,
                    engine_options: dict[str, Any] | None) -> tuple[dict[int, float], dict[str, int]]:
    """TTFT per length on one fresh engine, and the prompt steps per strategy the engine ran."""
    llm, _ = build_llm(model, layout, strategy="auto" if layout.dims.pcp > 1 else None, threads_per_rank=1,
                       context_tokens=max(lengths) + 16, batch_tokens=max(lengths) + 16,
                       engine_options=engine_options)
    try:
        time_prefill(llm, random_prompt(WARMUP_TOKENS, config.vocab_size, seed=-1))
        before = llm.engine.executor.rank_stats().strategy_counts
        times = {length: time_prefill(llm, random_prompt(length, config.vocab_size, seed=repeat * 1_000_003 + length))
                 for length in lengths}
        after = llm.engine.executor.rank_stats().strategy_counts
    finally:
        llm.shutdown()
    return times, {k: after[k] - before[k] for k in after if after[k] > before[k]}


def run_plan_check(model: str | None, *, lengths: list[int], repeats: int,
                   engine_options: dict[str, Any] | None = None,
                   calibrate: Callable[[], HardwareSpec] | None = None,
                   progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    from cpllm.planner.calibrate import calibrate as calibrate_machine

    config = model_config_of(model)
    calibrate = calibrate or (lambda: calibrate_machine(threads_per_rank=1, model=config))
    measured: dict[tuple[int, int], list[float]] = {}
    predicted: dict[tuple[int, int], list[float]] = {}
    strategies: dict[int, str] = {}
    ran: dict[str, int] = {}
    specs = []
    for repeat in range(repeats):
        hw = calibrate()
        specs.append(hw)
        for layout in LAYOUTS:
            times, counts = _measure_layout(model, layout, lengths, repeat, config, engine_options)
            for name, count in counts.items():
                ran[name] = ran.get(name, 0) + count
            for length, seconds in times.items():
                strategies[layout.dims.pcp], prediction = predict(config, hw, layout.dims.pcp, length)
                measured.setdefault((layout.dims.pcp, length), []).append(seconds)
                predicted.setdefault((layout.dims.pcp, length), []).append(prediction)
            if progress:
                progress(f"repeat {repeat + 1}: {layout.label()}")
    return {"points": _points(measured, predicted, strategies), "auto_ran_pcp2": ran,
            "efficiency": _efficiency(measured, lengths),
            "calibrations": [_spec_row(hw) for hw in specs], "specs": [dataclasses.asdict(hw) for hw in specs]}


def _points(measured, predicted, strategies) -> list[dict[str, Any]]:
    rows = []
    for (pcp, length), times in sorted(measured.items()):
        preds = predicted[(pcp, length)]
        errors = [(p - m) / m for p, m in zip(preds, times)]
        rows.append({
            "layout": f"1x{pcp}x1@1", "strategy": strategies[pcp], "prompt_tokens": length,
            "measured_s": round(statistics.median(times), 4), "predicted_s": round(statistics.median(preds), 4),
            "error": round(statistics.median(errors), 4),
            "measured_best_s": round(min(times), 4), "predicted_best_s": round(min(preds), 4),
            "errors_per_repeat": [round(e, 4) for e in errors],
            "measured_all_s": [round(t, 4) for t in times],
        })
    return rows


def _efficiency(measured, lengths: list[int]) -> list[dict[str, Any]]:
    rows = []
    for length in lengths:
        one, two = measured[(1, length)], measured[(2, length)]
        rows.append({"prompt_tokens": length, "ttft_1rank_s": round(min(one), 4), "ttft_pcp2_s": round(min(two), 4),
                     "efficiency": round(min(one) / (2 * min(two)), 3),
                     "efficiency_median": round(statistics.median(one) / (2 * statistics.median(two)), 3)})
    return rows


def _spec_row(hw: HardwareSpec) -> dict[str, Any]:
    return {"matmul_gflops": round(hw.peak_flops / 1e9, 1),
            "attention_gflops": round((hw.attention_flops or hw.peak_flops) / 1e9, 1),
            "attention_row_overhead": round(hw.attention_row_overhead, 1),
            "elementwise_gb_s": round((hw.elementwise_bw or 0) / 1e9, 2),
            "busy_node_fraction": round(hw.busy_node_fraction, 3), "p2p_mb_s": round(hw.intra_node_bw / 1e6, 1), "p2p_latency_us": round(hw.intra_node_latency_s * 1e6, 1),
            "memory_gb_s": round(hw.memory_bw / 1e9, 2)}
