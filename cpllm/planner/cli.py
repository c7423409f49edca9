"""`cpllm plan --model CONFIG (--gpu NAME | --hardware spec.json | --calibrate) --nodes N --context 128k`."""

from __future__ import annotations

import argparse
import json
import re
import sys

from cpllm.planner.cost_model import CostModel, Precision
from cpllm.planner.hardware import BUILTIN, builtin_hardware, load_hardware, save_hardware
from cpllm.planner.models import BUILTIN_MODELS, load_model_shape
from cpllm.planner.plan import LayoutPrediction, PlanRequest, plan

_TOKENS = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*$")
_SECONDS = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m)?\s*$")


def parse_tokens(text: str) -> int:
    """'131072', '128k' (x1024), '1m' (x1024^2) -> tokens."""
    match = _TOKENS.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a token count: {text!r} (examples: 8192, 128k, 1m)")
    scale = {"": 1, "k": 2**10, "m": 2**20}[match.group(2).lower()]
    return int(float(match.group(1)) * scale)


def parse_seconds(text: str) -> float:
    """'10s', '500ms', '2m', '10' -> seconds."""
    match = _SECONDS.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (examples: 10s, 500ms, 2m)")
    return float(match.group(1)) * {None: 1.0, "s": 1.0, "ms": 1e-3, "m": 60.0}[match.group(2)]


def add_plan_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help=f"config.json, model folder, .gguf, or one of {', '.join(BUILTIN_MODELS)}")
    hardware = parser.add_mutually_exclusive_group(required=True)
    hardware.add_argument("--gpu", choices=sorted(BUILTIN), help="published figures of a built-in device")
    hardware.add_argument("--hardware", help="a JSON spec (HardwareSpec fields; \"base\" names a built-in)")
    hardware.add_argument("--calibrate", action="store_true",
                          help="measure this machine (the model's projection and attention rates alone and with every "
                          "core busy, memory and gloo bandwidth)")
    parser.add_argument("--nodes", type=int, default=1, help="nodes of the cluster")
    parser.add_argument("--devices-per-node", type=int, default=None, help="override the spec's devices per node")
    parser.add_argument("--context", type=parse_tokens, required=True, help="tokens per request, e.g. 128k")
    parser.add_argument("--prefix-hit", type=float, default=0.0, help="share of the context already cached")
    parser.add_argument("--ttft-slo", type=parse_seconds, default=None, help="time-to-first-token objective")
    parser.add_argument("--batch", type=int, default=1, help="requests decoding together")
    parser.add_argument("--weights", choices=["fp8", "bf16", "fp16", "fp32"], default=None,
                        help="weight format (default: bf16 on GPUs, fp32 when calibrated on this CPU)")
    parser.add_argument("--efficiency", type=float, default=None,
                        help="override: one fraction of peak for GEMMs and attention alike (default: the device's "
                        "utilisations, fitted for the built-in GPUs)")
    parser.add_argument("--threads-per-rank", type=int, default=1, help="with --calibrate: threads of each rank")
    parser.add_argument("--save-hardware", default=None, help="with --calibrate: write the measured spec here")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--explain", action="store_true",
                        help="split the recommended layout's predicted TTFT into compute, exposed transfer, latency "
                        "and kernel launches (with --disaggregated: prefill compute, K/V transfer, latency)")
    parser.add_argument("--disaggregated", action="store_true",
                        help="predict a prefill instance feeding a decode instance (each its own devices) instead "
                        "of listing one cluster's layouts; needs --prefill-layout and --decode-layout")
    parser.add_argument("--prefill-layout", default=None, help="with --disaggregated: TPxPCPxDCP, e.g. 1x8x1")
    parser.add_argument("--decode-layout", default=None, help="with --disaggregated: TPxPCPxDCP, e.g. 8x1x8")


def run_plan(args: argparse.Namespace) -> int:
    import dataclasses

    model = load_model_shape(args.model)
    if args.calibrate:
        from cpllm.planner.calibrate import calibrate

        hw = calibrate(threads_per_rank=args.threads_per_rank, model=model)
        if args.save_hardware:
            save_hardware(hw, args.save_hardware)
    elif args.hardware:
        hw = load_hardware(args.hardware)
    else:
        hw = builtin_hardware(args.gpu)
    if args.devices_per_node is not None:
        hw = dataclasses.replace(hw, devices_per_node=args.devices_per_node)
    if args.efficiency is not None:
        hw = hw.with_efficiency(args.efficiency)
    on_cpu = args.calibrate or hw.name == "cpu"
    weights = args.weights or ("fp32" if on_cpu else "bf16")
    element = 4 if on_cpu else 2
    precision = Precision(weight_format=weights, activation_bytes=element, kv_bytes=element)
    cost = CostModel(model, hw, precision)
    request = PlanRequest(context=args.context, prefix_hit=args.prefix_hit, ttft_slo_s=args.ttft_slo,
                          batch=args.batch)
    if args.disaggregated or args.prefill_layout or args.decode_layout:
        from cpllm.planner.disagg_cli import run_disaggregated

        return run_disaggregated(args, cost, request, weights)
    devices = args.nodes * hw.devices_per_node
    predictions, best = plan(cost, devices, request)
    if args.json:
        report = {"hardware": dataclasses.asdict(hw), "model": args.model, "devices": devices,
                  "request": dataclasses.asdict(request), "precision": dataclasses.asdict(precision),
                  "layouts": [p.row() for p in predictions], "recommended": best.row() if best else None}
        if args.explain and best is not None:
            report["explain"] = ttft_parts(cost, best, request)
        json.dump(report, sys.stdout, indent=2)
        print()
        return 0
    print(f"{args.model} on {args.nodes} x {hw.devices_per_node} {hw.name} ({devices} devices), context "
          f"{request.context} tokens ({request.cached} cached), weights {weights}")
    print(utilization_line(hw))
    print(format_table([p.row() for p in predictions]))
    if best is None:
        print("recommended: none fits" + (" the TTFT objective" if args.ttft_slo is not None else "")
              + "; try more nodes or a smaller weight format")
    else:
        print(f"recommended: {best.layout.label()} (TTFT {best.ttft_s:.3g} s, "
              f"{best.decode_s_per_token * 1e3:.3g} ms per output token)")
        if args.explain:
            print(explain_line(ttft_parts(cost, best, request)))
    return 0


def ttft_parts(cost: CostModel, chosen: LayoutPrediction, request: PlanRequest) -> dict:
    """The chosen layout's predicted TTFT split into what the cost model adds up (seconds)."""
    strategy = "ring" if chosen.strategy == "-" else chosen.strategy
    parts = cost.prefill(chosen.layout, request.new, request.cached, strategy)
    return {"layout": chosen.layout.label(), "strategy": chosen.strategy, "compute_s": parts.compute_s,
            "exposed_transfer_s": parts.exposed_transfer_s, "latency_s": parts.latency_s,
            "launch_s": parts.launch_s, "total_s": parts.total_s}


def explain_line(parts: dict) -> str:
    total = parts["total_s"]
    shares = ", ".join(f"{label} {parts[key]:.4g} s ({parts[key] / total:.1%})" for label, key in (
        ("compute", "compute_s"), ("exposed transfer", "exposed_transfer_s"), ("latency", "latency_s"),
        ("kernel launches", "launch_s")))
    return f"TTFT of {parts['layout']} ({parts['strategy']}): {total:.4g} s = {shares}"


def utilization_line(hw) -> str:
    """What share of its peaks the spec's kernels reach, and where that comes from."""
    gemm, attention = hw.gemm_utilization * hw.efficiency, hw.attention_utilization * hw.efficiency
    source = hw.utilization_source or ("measured (--calibrate)" if hw.name.startswith("calibrated") else "not fitted")
    return (f"utilisation of peak: GEMMs {gemm:.3g}, attention {attention:.3g}, collectives "
            f"{hw.collective_utilization:.3g} ({source})")


COLUMNS = ("layout", "strategy", "ttft_s", "decode_ms_per_token", "kv_capacity_tokens", "weights_gib_per_device",
           "memory_gib_per_device", "fits", "meets_slo")


def format_table(rows: list[dict]) -> str:
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) if rows else len(c) for c in COLUMNS}
    lines = ["  ".join(c.ljust(widths[c]) for c in COLUMNS)]
    lines += ["  ".join(str(r[c]).ljust(widths[c]) for c in COLUMNS) for r in rows]
    return "\n".join(lines)
