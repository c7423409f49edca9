"""`cpllm plan --disaggregated` (planner/disagg.py): the K/V transfer counts the re-shard plan's rows on the busiest
NIC, TTFT adds prefill, transfer and the decode's first step, and DeepSeek's published throughputs
(planner/published_disagg.py) stay where docs/disaggregated.md "Planning a disaggregated deployment" says."""

from __future__ import annotations

import json

import pytest

from cpllm.cli import main
from cpllm.disagg.reshard import CacheLayout, plan_reshard
from cpllm.planner import published_disagg as published
from cpllm.planner.cost_model import CostModel, Precision
from cpllm.planner.disagg import kv_bytes_per_head_token, kv_transfer, parse_layout, predict_disaggregated
from cpllm.planner.hardware import builtin_hardware
from cpllm.planner.models import load_model_shape
from cpllm.planner.plan import PlanRequest, predict

FP8 = Precision(weight_format="fp8")


def cost_of(model: str, gpu: str, precision: Precision = FP8) -> CostModel:
    return CostModel(load_model_shape(model), builtin_hardware(gpu), precision)


def test_layout_labels_round_trip_and_bad_ones_are_named():
    for label in ("1x8x1", "8x1x8", "2x4x2-repl"):
        assert parse_layout(label).label() == label
    with pytest.raises(ValueError, match="'8x8'"):
        parse_layout("8x8")


def test_mla_prompt_moves_one_latent_row_per_layer_and_token_spread_over_every_nic():
    cost = cost_of("deepseek-v3", "h200")
    tokens = 131072
    kv = kv_transfer(cost, parse_layout("1x8x1"), parse_layout("8x1x8"), tokens)
    row = 61 * (512 + 64) * 2  # layers x (latent + rope) x bf16
    assert kv_bytes_per_head_token(cost) == row
    assert kv.total_bytes == tokens * row
    assert kv.busiest_nic_bytes == tokens * row / 8  # PCP rank r owns what DCP rank r owns: one move each
    assert kv.busiest_nic_messages == 1
    assert kv.link.transfer_s == pytest.approx(kv.busiest_nic_bytes / 50e9)


@pytest.mark.parametrize("model,src,dst", [
    ("llama3-8b", "2x2x1", "4x1x1"), ("llama3-8b", "1x2x1", "1x1x1"), ("llama3-8b", "4x1x1", "2x2x1-repl"),
    ("deepseek-v2-lite", "1x4x1", "4x1x4"), ("deepseek-v2-lite", "2x2x1", "4x1x2"),
    ("deepseek-v2-lite", "1x8x1", "8x1x8")])
def test_scaled_period_matches_the_whole_prompts_plan(model, src, dst):
    """The period's plan, scaled, gives the bytes of the plan of the whole prompt: in all and on the busiest NIC."""
    cost = cost_of(model, "h100", Precision())
    heads, row = cost.model.num_key_value_heads, kv_bytes_per_head_token(cost)
    tokens = 96
    source, target = (CacheLayout(dims=parse_layout(x), interleave=1, block_size=16) for x in (src, dst))
    load: dict = {}
    total = 0
    for move in plan_reshard(source, target, heads, tokens).moves:
        nbytes = move.num_positions * len(move.heads) * row
        total += nbytes
        for end in (("send", move.src_rank), ("recv", move.dst_rank)):
            load[end] = load.get(end, 0) + nbytes
    kv = kv_transfer(cost, parse_layout(src), parse_layout(dst), tokens)
    assert kv.busiest_nic_bytes == pytest.approx(max(load.values()))
    assert kv.total_bytes == pytest.approx(total)
    # each consumer rank receives each of its (position, head) rows once: at least the prompt's K/V in all
    assert total >= tokens * heads * row
    if dst == "1x1x1":
        assert kv.busiest_nic_bytes == kv.total_bytes == tokens * heads * row  # one rank receives all of it


def test_ttft_adds_prefill_transfer_and_first_decode_and_tpot_is_the_decode_layouts():
    cost = cost_of("deepseek-v3", "h200")
    request = PlanRequest(context=32768, batch=4)
    p = predict_disaggregated(cost, parse_layout("1x8x1"), parse_layout("8x1x8"), request)
    prefill_alone = predict(cost, parse_layout("1x8x1"), request)
    assert p.strategy == prefill_alone.strategy
    assert p.prefill_s == pytest.approx(prefill_alone.ttft_s)
    assert p.first_decode_s == pytest.approx(cost.decode_step(parse_layout("8x1x8"), 32768, 1))
    assert p.tpot_s == pytest.approx(predict(cost, parse_layout("8x1x8"), request).decode_s_per_token)
    assert p.ttft_s == pytest.approx(p.prefill_s + p.kv.link.total_s + p.first_decode_s)
    parts = p.explain()
    assert parts["compute_s"] + parts["transfer_s"] + parts["latency_s"] == pytest.approx(p.ttft_s)
    assert p.prefill_fits and p.decode_fits


DOCUMENTED = {  # context -> (TTFT s, K/V transfer s, TPOT ms) of DeepSeek-V3 on H200, 1x8x1 -> 8x1x8, FP8 weights
    4096: (0.1425, 0.000742, 26.30), 32768: (1.369, 0.005779, 26.35), 131072: (12.46, 0.02305, 26.53),
}


@pytest.mark.parametrize("context", sorted(DOCUMENTED))
def test_documented_deepseek_v3_figures(context):
    """The figures docs/disaggregated.md gives for prefill PCP=8 -> decode DCP=8 on H200."""
    p = predict_disaggregated(cost_of("deepseek-v3", "h200"), parse_layout("1x8x1"), parse_layout("8x1x8"),
                              PlanRequest(context=context))
    ttft, transfer, tpot_ms = DOCUMENTED[context]
    assert p.ttft_s == pytest.approx(ttft, rel=0.01)
    assert p.kv.link.total_s == pytest.approx(transfer, rel=0.01)
    assert p.tpot_s * 1e3 == pytest.approx(tpot_ms, rel=0.01)


def test_layouts_the_engine_refuses_are_refused_by_name():
    cost = cost_of("llama3-8b", "h100", Precision())
    with pytest.raises(ValueError, match="decode layout 8x1x8"):
        predict_disaggregated(cost, parse_layout("1x2x1"), parse_layout("8x1x8"), PlanRequest(context=1024))


def test_cli_prints_the_split_and_json(capsys):
    base = ["plan", "--model", "deepseek-v3", "--gpu", "h200", "--weights", "fp8", "--context", "128k",
            "--disaggregated", "--prefill-layout", "1x8x1", "--decode-layout", "8x1x8"]
    assert main(base + ["--explain"]) == 0
    out = capsys.readouterr().out
    assert "prefill 1x8x1 (8 devices, ring) -> decode 8x1x8 (8 devices)" in out
    assert "TTFT 12.46 s" in out and "K/V transfer" in out and "latency" in out
    assert main(base + ["--json", "--explain"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["disaggregated"]["kv_bytes"] == 131072 * 61 * 576 * 2
    assert report["explain"]["ttft_s"] == pytest.approx(12.46, rel=0.01)
    assert main(base + ["--ttft-slo", "10s"]) == 0
    assert "misses the TTFT objective of 10 s" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--decode-layout"):
        main(base[:-2])
    with pytest.raises(SystemExit, match="need --disaggregated"):
        main([a for a in base if a != "--disaggregated"])


# ---- DeepSeek's published deployment (a throughput, not a latency) ------------------------------------------------

PINNED = {"one_request": -0.879, "compute_only": +0.467}
"""Relative errors of the two per-node prefill rates against the published 73.7k input tokens/s (docs/disaggregated.md
"Planning a disaggregated deployment")."""


def prefill_rates() -> tuple[float, float]:
    """Per-node input tokens/s (cache hits counted, as the source counts them) of the 4-node unit as the model runs
    it: one request at a time (TTFT), and its compute terms alone (what batching and overlapped expert dispatch
    would approach)."""
    cost = cost_of(published.MODEL, published.GPU, Precision(weight_format=published.WEIGHTS))
    layout = parse_layout(published.PREFILL_LAYOUT)
    request = PlanRequest(context=published.PROMPT_TOKENS, prefix_hit=published.CACHE_HIT)
    strategy = predict(cost, layout, request).strategy
    parts = cost.prefill(layout, request.new, request.cached, strategy)
    per_node = published.PROMPT_TOKENS / published.PREFILL_NODES
    return per_node / parts.total_s, per_node / parts.compute_s


def test_published_prefill_throughput_lies_between_the_models_two_rates():
    one_request, compute_only = prefill_rates()
    figure = published.PREFILL_INPUT_TOKENS_PER_NODE_S
    assert one_request < figure < compute_only
    assert one_request / figure - 1 == pytest.approx(PINNED["one_request"], abs=0.02)
    assert compute_only / figure - 1 == pytest.approx(PINNED["compute_only"], abs=0.02)


def test_the_published_unit_fits_as_the_model_runs_it():
    cost = cost_of(published.MODEL, published.GPU, Precision(weight_format=published.WEIGHTS))
    memory = cost.memory(parse_layout(published.PREFILL_LAYOUT))
    assert memory.fits_weights
    assert parse_layout(published.PREFILL_LAYOUT).replica_size == 8 * published.PREFILL_NODES
    assert "decode" in published.NOT_PREDICTED
