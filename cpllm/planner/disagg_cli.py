"""`cpllm plan --disaggregated --prefill-layout TPxPCPxDCP --decode-layout TPxPCPxDCP`: print disagg.py's
prediction (a table line, or JSON), with --explain its TTFT split."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from cpllm.planner.cost_model import CostModel
from cpllm.planner.disagg import DisaggPrediction, parse_layout, predict_disaggregated
from cpllm.planner.plan import PlanRequest


def layouts_of(args: argparse.Namespace):
    """The two layouts, refused unless both are given with --disaggregated."""
    if not args.disaggregated:
        raise SystemExit("--prefill-layout and --decode-layout need --disaggregated")
    missing = [flag for flag, value in (("--prefill-layout", args.prefill_layout),
                                        ("--decode-layout", args.decode_layout)) if not value]
    if missing:
        raise SystemExit(f"--disaggregated needs {' and '.join(missing)} (TPxPCPxDCP, e.g. 1x8x1 and 8x1x8)")
    try:
        return parse_layout(args.prefill_layout), parse_layout(args.decode_layout)
    except ValueError as error:
        raise SystemExit(str(error)) from None


def run_disaggregated(args: argparse.Namespace, cost: CostModel, request: PlanRequest, weights: str) -> int:
    prefill_layout, decode_layout = layouts_of(args)
    try:
        prediction = predict_disaggregated(cost, prefill_layout, decode_layout, request)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    if args.json:
        report = {"hardware": dataclasses.asdict(cost.hw), "model": args.model,
                  "request": dataclasses.asdict(request), "precision": dataclasses.asdict(cost.precision),
                  "disaggregated": prediction.row(),
                  "meets_slo": request.ttft_slo_s is None or prediction.ttft_s <= request.ttft_slo_s}
        if args.explain:
            report["explain"] = prediction.explain()
        json.dump(report, sys.stdout, indent=2)
        print()
        return 0
    print(summary(args.model, cost, request, weights, prediction))
    if request.ttft_slo_s is not None:
        verdict = "meets" if prediction.ttft_s <= request.ttft_slo_s else "misses"
        print(f"{verdict} the TTFT objective of {request.ttft_slo_s:.4g} s")
    if args.explain:
        print(explain_line(prediction))
    return 0


def summary(model: str, cost: CostModel, request: PlanRequest, weights: str, p: DisaggPrediction) -> str:
    fits = "" if p.prefill_fits and p.decode_fits else (
        " (does not fit: " + ", ".join(role for role, ok in (("prefill", p.prefill_fits), ("decode", p.decode_fits))
                                       if not ok) + ")")
    return (f"{model} on {cost.hw.name}, weights {weights}, context {request.context} tokens ({request.cached} "
            f"cached), batch {request.batch}\n"
            f"prefill {p.prefill_layout.label()} ({p.prefill_layout.replica_size} devices, {p.strategy}) -> decode "
            f"{p.decode_layout.label()} ({p.decode_layout.replica_size} devices){fits}\n"
            f"TTFT {p.ttft_s:.4g} s = prefill {p.prefill_s:.4g} s + K/V transfer {p.kv.link.total_s:.4g} s "
            f"({p.kv.total_bytes / 2**30:.3g} GiB, {p.kv.busiest_nic_bytes / 2**30:.3g} GiB on the busiest NIC) + "
            f"first decode step {p.first_decode_s:.4g} s; TPOT {p.tpot_s * 1e3:.4g} ms")


def explain_line(p: DisaggPrediction) -> str:
    parts = p.explain()
    total = parts["ttft_s"]
    shares = ", ".join(f"{label} {parts[key]:.4g} s ({parts[key] / total:.1%})" for label, key in (
        ("compute", "compute_s"), ("transfer", "transfer_s"), ("latency", "latency_s")))
    return (f"TTFT {total:.4g} s = {shares}; of which K/V transfer {parts['kv_transfer_s']:.4g} s and its latency "
            f"{parts['kv_latency_s']:.4g} s, the prefill's own transfers {parts['prefill_transfer_s']:.4g} s, the "
            f"first decode step {parts['first_decode_s']:.4g} s (counted as compute)")
