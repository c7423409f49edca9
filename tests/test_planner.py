"""The cost model and `cpllm plan` against published results (pure computation, no processes).

Yang et al., "Context Parallelism for Scalable Million-Token Inference" (arXiv 2411.01783), Llama 3 405B with
FP8 weights on 8 x H100 nodes (every number with its source in cpllm/planner/published.py):
- The model gets the H100's published peaks (989 / 1979 TFLOP/s BF16 / FP8, 3.35 TB/s HBM, 450 GB/s NVLink each
  way, one 400 Gb/s NIC per GPU) and two fitted utilisations, GEMMs' and attention's, fitted on Table 7's CP1
  (128K, one node, 42.0 s) and the abstract's 1M tokens on 16 nodes (77 s). They are the built-in H100's defaults.
- Predicted, not fitted: Table 7's CP2 21.0 s, CP4 10.95 s (TP8 in each node, CP across nodes), TP16 29.9 s, TP32
  19.8 s (TP across nodes), each within 15%; the abstract's 128K on 16 nodes (3.8 s) and Table 4's partial
  prefill times are predicted and their errors pinned where they stand (the model is known to be fast there).
- Table 4, partial prefill on CP4 with 128,000 tokens in all, by KV cache miss rate T / (T + P): pass-Q is faster
  at 1% (898.7 vs 1,023.4 ms) and 2.5%, the two are even at 5%, pass-KV is faster at 10% (2,080.7 vs 2,205.3 ms)
  and for a full prefill (the paper's choice for it). The paper's rule must pick the faster one on each of those
  rows; the cost model's own times (of the paper's pass-KV) must order the 1%, 10% and 100% rows the same way.
`auto` itself compares the cost model's times of cpllm's two strategies (strategy.py); its picks on the paper's
cluster and on this CPU are checked too.
"""

from __future__ import annotations

import json

import pytest
import torch

from cpllm.cli import main
from cpllm.distributed.parallel_dims import ParallelDims
from cpllm.planner.cost_model import CostModel, Precision
from cpllm.planner.fit import Measured, fit_utilizations
from cpllm.planner.hardware import (FITTED_ATTENTION_UTILIZATION, FITTED_GEMM_UTILIZATION, FITTED_ON,
                                    builtin_hardware)
from cpllm.planner.models import load_model_shape
from cpllm.planner.paper_check import (fitted_utilizations, measured, one_factor_cost, paper_cost,
                                       published_predictions)
from cpllm.planner.paper_rule import HeuristicInputs, paper_choice
from cpllm.planner.plan import PlanRequest, auto_strategy, valid_layouts
from cpllm.planner.published import FIT_POINTS, FRESH, TABLE4_FASTER, TABLE4_TOKENS, TABLE7_TOKENS
from cpllm.planner.strategy import StepSizes, choose

TOKENS_128K = TABLE7_TOKENS
TOLERANCE = 0.15
TABLE4_TOTAL = TABLE4_TOKENS
KNOWN_SHORT = {"CP16 128K": (-0.35, -0.20), "CP4 1% miss, pass-q": (-0.85, -0.70),
               "CP4 1% miss, pass-kv": (-0.85, -0.70), "CP4 10% miss, pass-kv": (-0.40, -0.25),
               "CP4 10% miss, pass-q": (-0.35, -0.20)}
"""Predictions known to fall short, and by how much (docs/context_parallel.md says why): pinned so that a change
of the model that moves them shows here."""


def test_builtin_h100_defaults_are_the_fit_on_cp1_and_the_1m_run():
    gemm, attention = fitted_utilizations()
    hw = builtin_hardware("h100")
    assert (hw.gemm_utilization, hw.attention_utilization) == (FITTED_GEMM_UTILIZATION, FITTED_ATTENTION_UTILIZATION)
    assert gemm == pytest.approx(FITTED_GEMM_UTILIZATION, abs=1e-3)
    assert attention == pytest.approx(FITTED_ATTENTION_UTILIZATION, abs=1e-3)
    assert 0.2 < gemm < attention < 0.8, "attention runs nearer its peak than the FP8 projections do"
    assert hw.efficiency == 1.0 and hw.collective_utilization == 1.0 and hw.utilization_source == FITTED_ON
    assert builtin_hardware("h200").gemm_utilization == FITTED_GEMM_UTILIZATION
    assert "carried over" in builtin_hardware("h200").utilization_source
    assert all(builtin_hardware(name).source for name in ("h100", "h200", "h800", "a100", "cpu"))


def test_every_published_point_with_its_source_and_the_fit_points_exact():
    rows = {row["name"]: row for row in published_predictions()}
    assert all(row["source"].startswith("arXiv 2411.01783") for row in rows.values())
    assert {name for name, row in rows.items() if row["fitted"]} == set(FIT_POINTS)
    for name in FIT_POINTS:  # the defaults, rounded to three digits, reproduce the fit points
        assert abs(rows[name]["error"]) < 2e-3, rows[name]


def test_table7_predicted_within_15_percent():
    rows = published_predictions()
    table7 = [row for row in rows if row["tokens"] == TOKENS_128K and row["nodes"] <= 4 and not row["cached"]]
    assert {row["name"] for row in table7} == {"CP1", "CP2", "CP4", "TP16", "TP32"}
    bad = {row["name"]: f"{row['error']:+.1%}" for row in table7 if abs(row["error"]) > TOLERANCE}
    assert not bad, f"predictions off by more than {TOLERANCE:.0%}: {bad}"


def test_points_the_model_is_known_to_miss_stay_where_they_are():
    rows = {row["name"]: row for row in published_predictions()}
    for name, (low, high) in KNOWN_SHORT.items():
        assert low <= rows[name]["error"] <= high, (name, rows[name])


def test_one_factor_cannot_hold_at_both_lengths():
    """The model before: one efficiency fitted on CP1 misses the 1M run by over 20%; the two rates fit it."""
    rows = {row["name"]: row for row in published_predictions(one_factor_cost())}
    assert abs(rows["CP1"]["error"]) < 1e-3
    assert rows["CP16 1M"]["error"] > 0.2


def test_fit_refuses_points_that_cannot_separate_the_rates():
    points = {p.name: measured(p) for p in FRESH}
    with pytest.raises(ValueError, match="same attention share"):
        fit_utilizations(paper_cost(), points["CP1"], points["CP4"])
    too_fast = Measured(name="too fast", layout=ParallelDims(tp=8, pcp=16), tokens=1024 * 1024, seconds=10.0)
    with pytest.raises(ValueError, match="outside"):
        fit_utilizations(paper_cost(), points["CP1"], too_fast)


def test_plan_without_flags_prints_the_papers_1m_run(capsys):
    assert main(["plan", "--model", "llama3-405b", "--gpu", "h100", "--nodes", "16", "--context", "1m",
                 "--weights", "fp8"]) == 0
    out = capsys.readouterr().out
    assert "fitted on arXiv 2411.01783" in out and "GEMMs 0.302, attention 0.572" in out
    row = next(line.split() for line in out.splitlines() if line.startswith("8x16x1 "))
    assert float(row[2]) == pytest.approx(77.0, rel=0.01)
    assert "recommended: 8x16x1 (TTFT 77 s" in out
    assert main(["plan", "--model", "llama3-405b", "--gpu", "h100", "--nodes", "16", "--context", "1m",
                 "--weights", "fp8", "--efficiency", "0.5"]) == 0
    assert "GEMMs 0.5, attention 0.5" in capsys.readouterr().out


def test_table4_crossover_on_the_right_side():
    cost = paper_cost()
    cp4 = ParallelDims(tp=8, pcp=4)
    hq, hkv = cost.local_heads(cp4.tp)
    rule = HeuristicInputs(pcp=4, flops=cost.hw.peak_flops, bandwidth=cost.hw.inter_node_bw, kv_heads=hkv,
                           query_heads=hq, element_bytes=2)
    for miss, faster in TABLE4_FASTER.items():  # the paper's closed form, with peak figures
        new = round(TABLE4_TOTAL * miss)
        pick = paper_choice(StepSizes(new=new, cached=TABLE4_TOTAL - new), rule)
        assert pick == ("pass-q" if faster == "pass-q" else "ring"), (miss, pick)
    for miss in (0.01, 0.10, 1.0):  # the cost model's own times, for the paper's pass-KV
        new = round(TABLE4_TOTAL * miss)
        picked = choose(cost, cp4, StepSizes(new=new, cached=TABLE4_TOTAL - new), ("pass-kv", "pass-q"))
        assert picked.strategy == TABLE4_FASTER[miss], f"miss rate {miss}: {picked.predicted_s}"


def test_auto_on_cpllms_strategies_for_the_papers_cluster():
    """cpllm's ring serves a cached context with a blocking query gather: with any cached context on four nodes
    pass-Q is predicted faster; a fresh prompt takes the ring."""
    cost, cp4 = paper_cost(), ParallelDims(tp=8, pcp=4)
    for miss in (0.01, 0.10, 0.5):
        assert auto_strategy(cost, cp4, PlanRequest(context=TABLE4_TOTAL, prefix_hit=1 - miss)) == "pass-q", miss
    assert auto_strategy(cost, cp4, PlanRequest(context=TABLE4_TOTAL)) == "ring"


def cpu_engine_cost(model: str, pcp: int = 2):
    """What the engine's `auto` consults on this CPU with one thread per rank (fp32)."""
    from cpllm.config.engine import ParallelConfig
    from cpllm.planner.runtime import device_hardware, engine_cost

    parallel = ParallelConfig(prefill_context_parallel_size=pcp, cp_prefill_strategy="auto")
    return engine_cost(parallel, load_model_shape(model), 4, device_hardware(torch.device("cpu"), threads=1))


@pytest.mark.parametrize("new, cached, expected", [
    (256, 4096, "pass-q"),  # measured: ring 1.33 s, pass-Q 1.18 s (the paper's rule picks the ring here)
    (256, 8192, "pass-q"),
    (64, 4096, "pass-q"),
    (4096, 0, "allgather"),  # measured on the default weights: all-gather 1.78 s, ring 2.05 s (one call per rank)
    (8192, 0, "allgather"),
    (90, 0, "allgather"),
])
def test_auto_picks_by_the_cost_model_on_this_cpu(new, cached, expected):
    engine = cpu_engine_cost("smollm2-135m")
    choice = choose(engine.cost, engine.layout, StepSizes(new=new, cached=cached))
    assert choice.strategy == expected, choice.predicted_s


def test_auto_weighs_the_all_gather_only_where_collectives_go_through_shared_memory():
    """With --collective-transport gloo the all-gather crosses loopback TCP like the ring's messages, and has no
    place among auto's candidates; the shared-memory rate moves only one host's exchanges, never a network's."""
    from cpllm.planner.runtime import device_hardware
    from cpllm.planner.strategy import engine_choices

    shared = cpu_engine_cost("smollm2-135m").cost
    assert engine_choices(shared) == ("ring", "pass-q", "allgather")
    gloo = CostModel(shared.model, device_hardware(torch.device("cpu"), threads=1, shared_memory=False),
                     shared.precision)
    choice = choose(gloo, ParallelDims(pcp=2), StepSizes(new=4096, cached=0))
    assert set(choice.predicted_s) == {"ring", "pass-q"} and choice.strategy == "ring"
    block = 3 << 20
    assert shared.exchange_link(block, 1, inter=False).transfer_s < gloo.exchange_link(block, 1, inter=False).transfer_s
    assert shared.exchange_link(block, 1, inter=True) == gloo.exchange_link(block, 1, inter=True)


def test_papers_rule_would_pick_the_ring_for_a_short_chunk_here():
    """Why `auto` does not use the closed form: on this CPU it sends 256 new tokens on 4,096 cached round the
    ring (T is above its overlap threshold), which cpllm runs slower than pass-Q."""
    hw = cpu_engine_cost("smollm2-135m").cost.hw
    rule = HeuristicInputs(pcp=2, flops=hw.attention_peak(), bandwidth=hw.intra_node_bw, kv_heads=3, query_heads=9,
                           element_bytes=4)
    assert paper_choice(StepSizes(new=256, cached=4096), rule) == "ring"


def test_heuristic_thresholds_follow_the_formula():
    inputs = HeuristicInputs(pcp=4, flops=989.4e12, bandwidth=50e9, kv_heads=1, query_heads=16, element_bytes=2)
    assert inputs.overlap_threshold == pytest.approx(4 * 989.4e12 * 1 * 2 / (2 * 16 * 50e9))
    assert inputs.miss_rate_threshold == pytest.approx(2 * 1 / 16)
    assert paper_choice(StepSizes(new=100, cached=0), inputs) == "ring"  # a fresh prompt: the K/V message is smaller
    assert paper_choice(StepSizes(new=100, cached=100_000), inputs) == "pass-q"
    assert paper_choice(StepSizes(new=10_000, cached=1_000_000), inputs) == "ring"  # long enough to hide the ring
    with pytest.raises(ValueError, match="T=0"):
        paper_choice(StepSizes(new=0, cached=5), inputs)


def test_attention_flops_match_the_benchmarks_formula():
    from cpllm.bench.ceiling import prefill_flops

    cost = CostModel(load_model_shape("smollm2-135m"), builtin_hardware("cpu"), Precision(weight_format="fp32"))
    reference = prefill_flops(cost.model, 4096)
    assert cost.attention_flops(4096, 0) == pytest.approx(reference.attention)
    assert cost.linear_flops(4096) == pytest.approx(reference.linear)


def test_layouts_are_the_ones_the_engine_accepts():
    model = load_model_shape("smollm2-135m")  # 9 query heads, 3 KV heads: TP in {1, 3, 9}
    labels = {layout.label() for layout in valid_layouts(model, 6)}
    assert labels == {"1x6x1", "1x6x1-repl", "3x2x1", "3x2x1-repl"}
    model = load_model_shape("llama3-405b")  # 8 KV heads: TP16 replicates each over 2 ranks, so DCP 2 is valid
    assert {layout.label() for layout in valid_layouts(model, 16) if layout.tp == 16} == {"16x1x1", "16x1x2"}


def test_replicated_layout_trades_capacity_for_decode():
    cost = paper_cost()
    sharded, replicated = ParallelDims(tp=8, pcp=4), ParallelDims(tp=8, pcp=4, kv_replicated=True)
    assert cost.memory(sharded).kv_capacity_tokens == 4 * cost.memory(replicated).kv_capacity_tokens
    assert cost.decode_step(replicated, TOKENS_128K, batch=16) < cost.decode_step(sharded, TOKENS_128K, batch=16)


def test_plan_command_prints_json_and_recommends_a_layout_that_fits(capsys):
    assert main(["plan", "--model", "llama3-405b", "--gpu", "h100", "--nodes", "2", "--context", "128k",
                 "--prefix-hit", "0.9", "--ttft-slo", "10s", "--weights", "fp8", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["devices"] == 16 and report["request"]["context"] == TOKENS_128K
    rows = {row["layout"]: row for row in report["layouts"]}
    assert not rows["1x16x1"]["fits"], "405B FP8 weights do not fit one H100 without TP"
    best = report["recommended"]
    assert best is not None and best["fits"] and best["ttft_s"] <= 10
    assert best["decode_ms_per_token"] == min(r["decode_ms_per_token"] for r in rows.values()
                                              if r["fits"] and r["meets_slo"])


def test_plan_command_table_and_bad_input(capsys, tmp_path):
    spec = tmp_path / "gpu.json"
    spec.write_text(json.dumps({"base": "h100", "inter_node_bw": 12.5e9, "efficiency": 0.4}))
    assert main(["plan", "--model", "llama3-8b", "--hardware", str(spec), "--context", "32k"]) == 0
    out = capsys.readouterr().out
    assert "recommended:" in out and "8x1x1" in out
    spec.write_text(json.dumps({"base": "h100", "nvlink": 1}))
    with pytest.raises(ValueError, match="unknown hardware fields"):
        main(["plan", "--model", "llama3-8b", "--hardware", str(spec), "--context", "32k"])
    with pytest.raises(SystemExit):
        main(["plan", "--model", "llama3-8b", "--gpu", "h100", "--context", "lots"])
