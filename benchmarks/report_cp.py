"""The sections of docs/benchmarks.md on context-parallel strategies, layouts and the planner (issue 12).

(a) a short chunk on a cached context per strategy, (b) decode under PCP=2 in both KV layouts, (c) the planner's
predictions against the published and the measured points (a plot), (d) PCP=2 prefill efficiency and where the
rest goes. Every figure comes from benchmarks/results/*.json or from the cost model; nothing is typed in.
"""

from __future__ import annotations

import os
import statistics
from typing import Any

from report_sections import Results, _missing, md_table

SAME_THREADS = "1x1x1@2"
"""The single-rank run with PCP=2's total threads, the reference of (b)."""


def _point(row: dict[str, Any]) -> tuple[int, int, int]:
    return row.get("round", 0), row["batch_size"], row["context_tokens"]


def _vs_same_threads(data: dict[str, Any]) -> dict[int, float]:
    """Index of each result row in a decode_pcp_*.json -> its tokens/s over the SAME_THREADS run of the same round,
    batch and context."""
    single = {_point(r): r["tokens_per_s"] for r in data["results"] if r["layout"] == SAME_THREADS}
    return {i: r["tokens_per_s"] / single[_point(r)] for i, r in enumerate(data["results"])}


def round_ratios(data: dict[str, Any]) -> dict[tuple[str, int, int], list[float]]:
    """(layout, batch, context) -> its tokens/s over SAME_THREADS in each round, in round order."""
    ratios = _vs_same_threads(data)
    by_point: dict[tuple[str, int, int], list[float]] = {}
    for i, r in sorted(enumerate(data["results"]), key=lambda item: _point(item[1])):
        by_point.setdefault((r["layout"], r["batch_size"], r["context_tokens"]), []).append(ratios[i])
    return by_point


def ratio_cell(ratios: list[float]) -> str:
    """The median ratio, and each round's when there are several."""
    if len(ratios) == 1:
        return f"{ratios[0]:.2f}"
    return f"{statistics.median(ratios):.2f} (rounds: {', '.join(f'{x:.2f}' for x in ratios)})"


def cp_targets_section(results: Results, images: str, rel: str) -> list[str]:
    """The issue's targets for (b), (c) and (d), computed from the same files as the sections below."""
    rows: list[dict[str, Any]] = []
    plan = results.get("plan_check")
    if plan:
        for row in plan["efficiency"]:
            rows.append({"target": f"PCP=2 prefill efficiency, auto, {row['prompt_tokens']} tokens (d)",
                         "goal": ">= 0.95", "measured": f"{row['efficiency']} (median {row['efficiency_median']})"})
        worst = max(plan["points"], key=lambda r: abs(r["error"]))
        rows.append({"target": "plan --calibrate vs measured TTFT, PCP 1 and 2, 4K and 8K (c)", "goal": "within 15%",
                     "measured": f"worst {worst['error']:+.1%} ({worst['layout']}, {worst['prompt_tokens']})"})
    for kv_layout in ("replicated", "sharded"):
        data = results.get(f"decode_pcp_{kv_layout}")
        if not data:
            continue
        for (layout, batch, _), ratios in round_ratios(data).items():
            if not layout.startswith("1x1x1"):
                which = "(b)" if kv_layout == "replicated" else "(issue 10)"
                rows.append({"target": f"{kv_layout} PCP=2 decode / 1 rank same threads, batch {batch} {which}",
                             "goal": ">= 1", "measured": ratio_cell(ratios)})
    lines = ["## Context-parallel strategies, layouts and the planner (issue 12)", "",
             "Targets, computed from the results of the sections (a)-(d) below.", ""]
    return lines + (md_table(rows) if rows else _missing("plan"))


def chunk_section(results: Results, images: str, rel: str) -> list[str]:
    lines = ["### (a) A short chunk on a cached context: ring vs pass-Q vs auto", "",
             "`cpllm bench chunk`: the context is prefilled once and stays in the prefix cache; each repeat sends it "
             "again with fresh new tokens, so only the chunk is computed. `ran` is what the engine's step counter "
             "says each strategy ran (auto's choices); `vs_ring` compares medians with the ring on the same layout. "
             "Each strategy runs in its own engine, one after the other: `auto` runs the kernels of the strategy in "
             "`ran`, so a gap between it and that strategy's row is the machine's load changing in between.",
             ""]
    data = results.get("chunk_pcp")
    if not data:
        return lines + _missing("chunk")
    ring = {r["layout"]: r["ttft_median_s"] for r in data["results"] if r["strategy"] == "ring"}
    rows = [{**r, "vs_ring": round(r["ttft_median_s"] / ring[r["layout"]], 3) if r["layout"] in ring else None}
            for r in data["results"]]
    return lines + md_table(rows) + ["", f"Load average at the start and end: {_loads(data)}."]


DECODE_RUNS = (("sharded", "sharded"), ("gloo", "sharded, gloo transport"), ("replicated", "replicated"))
"""(file suffix of decode_pcp_*.json, what its PCP rows are labelled)."""


def decode_layouts_section(results: Results, images: str, rel: str) -> list[str]:
    lines = ["### (b) Decode under PCP=2: sharded vs replicated KV layout", "",
             "`cpllm bench decode --shared-prefix`, once per `--cp-kv-cache-layout`, each run with the single-rank "
             "engine on the same total threads (`1x1x1@2`, and on one thread) next to PCP=2 with one thread per rank. "
             "Each run repeats its layouts in rounds (the order rotating, so that none always runs first), and "
             "`vs_1rank` = tokens/s over the `1x1x1@2` run of the same round, batch and context: the median over "
             "the rounds, then each round's (the target: >= 1 for `replicated`). `tokens_per_s` is the median over "
             "the rounds. The `gloo transport` rows are the sharded layout with `--collective-transport gloo` "
             "(every collective over loopback TCP, as before the shared-memory path), with their own `1x1x1@2` "
             "reference run. On the shared-memory transport the PCP ranks decode as one team (each streams half of "
             "every layer's weights and attends to its part of the context: architecture.md, 'Decode team'); over "
             "gloo there is no team and the sharded layout's decode steps run eager. Two threads in one process "
             "suffer most when other processes share the cores (OpenMP threads wait for each other), so the load "
             "averages are printed below the table.", ""]
    rows, loads = [], []
    for name, label in DECODE_RUNS:
        data = results.get(f"decode_pcp_{name}")
        if not data:
            continue
        loads.append(f"{label}: {_loads(data)}")
        for row in _median_rows(data):
            if row["layout"].startswith("1x1x1") and name != "sharded":
                continue  # shown once, from the sharded run's file
            rows.append({"layout": row["layout"], "kv_layout": "-" if row["layout"].startswith("1x1x1") else label,
                         **{k: v for k, v in row.items() if k != "layout"}})
    if not rows:
        return lines + _missing("decode_layouts")
    return lines + md_table(rows) + ["", "Load average (1, 5, 15 min) at the start and end of each run, "
                                     "from the JSON: " + "; ".join(loads) + "."]


def _median_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (layout, batch, context) of a decode run in rounds: median tokens/s, ratio to SAME_THREADS."""
    speeds: dict[tuple[str, int, int], list[float]] = {}
    for r in data["results"]:
        speeds.setdefault((r["layout"], r["batch_size"], r["context_tokens"]), []).append(r["tokens_per_s"])
    return [{"layout": layout, "batch": batch, "context": context, "rounds": len(ratios),
             "tokens_per_s": round(statistics.median(speeds[(layout, batch, context)]), 2),
             "vs_1rank": ratio_cell(ratios)}
            for (layout, batch, context), ratios in round_ratios(data).items()]


def dcp_decode_section(results: Results, images: str, rel: str) -> list[str]:
    lines = ["### Decode under TP=2 and DCP=2: the tensor-parallel decode team", "",
             "`benchmarks/dcp_decode.py`: DCP=2 needs TP ranks that hold the same KV heads, which SmolLM2 (9 query, "
             "3 KV heads) cannot give, so this is SmolLM2's shape with one KV head (30 layers, hidden 576, 8 query "
             "heads of 64, MLP 1536; random weights, quantized to int4 at load; a small vocabulary). `bench decode "
             "--shared-prefix` in rounds as above: one rank on one and two threads, TP=2 and TP=2 x DCP=2 with one "
             "thread per rank (layout TPxPCPxDCP@threads). The TP ranks of one host decode as one team "
             "(architecture.md, 'Decode team'): each streams its own weight shards, and the partial sums (and under "
             "DCP each group's queries and attention parts) meet in shared memory instead of collectives.", ""]
    data = results.get("decode_dcp")
    if not data:
        return lines + _missing("dcp")
    return lines + md_table(_median_rows(data)) + ["", f"Load average at the start and end: {_loads(data)}."]


def transport_section(results: Results, images: str, rel: str) -> list[str]:
    lines = ["### Collective latency: gloo against shared memory", "",
             "`benchmarks/collective_latency.py`: one thread per rank, the same ranks timed with a plain gloo group "
             "and with the shared-memory fast path (`--collective-transport auto`, the default), alternating in "
             "rounds, median round. The payloads are what decode sends: a token's hidden state per MLP or TP "
             "layer, the attention partials of 16 tokens per layer, the replicated layout's K/V sync per step, "
             "and the step message the driver broadcasts.", ""]
    data = results.get("collective_latency")
    if not data:
        return lines + _missing("transport")
    return lines + md_table(data["results"]) + ["", f"Load average at the start and end: {_loads(data)}."]


def _loads(data: dict[str, Any]) -> str:
    machine = data.get("machine", {})
    return f"{machine.get('load_average_start')} -> {machine.get('load_average_end')}"


def planner_section(results: Results, images: str, rel: str) -> list[str]:
    from cpllm.planner.paper_check import other_engine_predictions, published_predictions
    from cpllm.planner.published import FIT_POINTS

    paper, engines = published_predictions(), other_engine_predictions()
    columns = ["name", "nodes", "layout", "tokens", "cached", "published_s", "predicted_s", "error", "fitted", "source"]
    lines = ["### (c) `cpllm plan`: predicted against published and measured TTFT", "",
             "Published: every point of the paper (arXiv 2411.01783; Llama 3 405B, FP8, H100 nodes) that states a "
             "time, predicted from the H100's published peaks with two utilisations (GEMMs', attention's) fitted on "
             f"{' and '.join(FIT_POINTS)}; every other row is a prediction. Measured: `cpllm bench plan` on this "
             "machine, SmolLM2 fp32, one thread per rank; each repeat's `--calibrate` figures, measured right "
             "before it, predict that repeat, and `error` is the median of the per-repeat errors (`measured_s`, "
             "`predicted_s`: medians). The model counts NCCL's published latencies (never hidden: a ring step costs "
             "max(compute, transfer) + latency) and CUDA's launch cost per kernel. tests/test_planner.py asserts "
             "Table 7 within 15%; tests/test_planner_fixed_costs.py asserts every point outside the fit within 15% "
             "or one of the documented misses (docs/context_parallel.md, 'Points outside the fit': the table "
             "before and after those terms, and the term each miss lacks); tests/test_plan_calibrated.py asserts "
             "this machine's points within 15%.", "", "Published points:", ""] + md_table(paper, columns)
    lines += ["", "Other engines (vLLM PR 44967: DeepSeek-V2-Lite, BF16, on 8 x H800, the H100's utilisations "
              "carried over; measured in a concurrent serving run, so each TTFT holds a queue wait the model "
              "lacks, docs/context_parallel.md 'Other engines'):", ""]
    lines += md_table(engines, [c for c in columns if c not in ("cached", "fitted", "source")])
    data = results.get("plan_check")
    measured = data["points"] if data else []
    if data:
        lines += ["", "This machine (`auto` ran: " + ", ".join(f"{k} {v}" for k, v in data["auto_ran_pcp2"].items())
                  + " prompt steps on PCP=2):", ""]
        lines += md_table(measured, ["layout", "strategy", "prompt_tokens", "measured_s", "predicted_s", "error",
                                     "measured_best_s", "predicted_best_s"])
        lines += ["", "Calibrations (one per repeat):", ""] + md_table(data["calibrations"])
        lines += ["", f"Load average at the start and end: {_loads(data)}."]
    else:
        lines += [""] + _missing("plan")
    _plot_planner(paper, measured, os.path.join(images, "plan_vs_measured.png"), engines)
    return lines + ["", f"![plan vs published and measured]({rel}/plan_vs_measured.png)"]


def _plot_planner(paper: list[dict], measured: list[dict], path: str, engines: list[dict] = ()) -> None:
    from cpllm.bench.plot import _save, plt

    fig, ax = plt.subplots(figsize=(6.4, 5.6))
    points = [(r["published_s"], r["predicted_s"], r["name"], "C2" if r["fitted"] else "C0") for r in paper]
    points += [(r["published_s"], r["predicted_s"], r["name"].removeprefix("vLLM "), "C3") for r in engines
               if r["tokens"] > 1024]  # the 1K rows, queue wait alone, are in the table
    points += [(r["measured_s"], r["predicted_s"], f"{r['layout'].split('@')[0]} {r['prompt_tokens']}", "C1")
               for r in measured]
    for x, y, name, color in points:
        ax.scatter([x], [y], color=color, zorder=3)
        ax.annotate(name, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    values = [v for x, y, _, _ in points for v in (x, y)]
    low, high = min(values) / 1.5, max(values) * 1.5
    line = [low, high]
    ax.plot(line, line, "k-", lw=0.8, label="predicted = actual", zorder=2)
    ax.fill_between(line, [v * 0.85 for v in line], [v * 1.15 for v in line], color="0.85", label="±15%", zorder=1)
    ax.scatter([], [], color="C2", label="paper, H100 nodes: the two fit points")
    ax.scatter([], [], color="C0", label="paper, H100 nodes: predicted")
    ax.scatter([], [], color="C3", label="vLLM PR 44967, H800s (queued: published high)")
    ax.scatter([], [], color="C1", label="this machine, SmolLM2 (measured)")
    ax.set(xscale="log", yscale="log", xlim=line, ylim=line, xlabel="published / measured TTFT (s)",
           ylabel="cpllm plan's predicted TTFT (s)", title="cpllm plan vs reality")
    ax.legend(fontsize=8, loc="upper left")
    _save(fig, path)


def efficiency_section(results: Results, images: str, rel: str) -> list[str]:
    lines = ["### (d) PCP=2 prefill parallel efficiency", "",
             "Efficiency = TTFT(1 rank, 1 thread) / (2 x TTFT(PCP=2, 1 thread per rank)), fresh prompts, "
             "`--cp-prefill-strategy auto` (the runs of (c)); target >= 0.95.", ""]
    data = results.get("plan_check")
    lines += md_table(data["efficiency"]) if data else _missing("plan")
    breakdown = results.get("prefill_breakdown")
    lines += ["", "Where the rest goes: `benchmarks/profile_prefill.py` profiles rank 0 (torch.profiler, self CPU "
              "time per operator) of a one-rank and a PCP=2 prefill. Each row is PCP=2 rank 0's time in the "
              "category minus half the one-rank time in it, as a share of the PCP=2 profile's wall time: the "
              "efficiency points it costs (a negative share: PCP=2 spends less than half). Pad rows and attention "
              "imbalance are counted from the head-tail partition.", ""]
    if not breakdown:
        return lines + _missing("breakdown")
    return lines + _breakdown_rows(breakdown["results"]) + ["", f"Load average at the start: "
                                                             f"{breakdown['machine'].get('load_average_start')}."]


def _breakdown_rows(results: list[dict[str, Any]]) -> list[str]:
    single = {r["prompt_tokens"]: r for r in results if r["layout"].startswith("1x1x1")}
    rows = []
    for r in results:
        one = single.get(r["prompt_tokens"])
        if r["layout"].startswith("1x1x1") or one is None:
            continue
        mine, base, wall = r["rank0_profile_s"], one["rank0_profile_s"], r["rank0_profile_s"]["wall"]
        part = r["partition"]
        row: dict[str, Any] = {"tokens": r["prompt_tokens"], "ttft_1rank_s": one["ttft_s"], "ttft_pcp2_s": r["ttft_s"],
                               "efficiency": round(one["ttft_s"] / (2 * r["ttft_s"]), 3),
                               "pad_rows": part["pad_rows"], "attention_imbalance": part["attention_imbalance"]}
        for category in ("linear", "attention kernel", "other ops", "collectives", "untracked (python, scheduling)"):
            row[category] = round((mine.get(category, 0.0) - base.get(category, 0.0) / 2) / wall, 3)
        rows.append(row)
    return md_table(rows)


CP_SECTIONS = [cp_targets_section, chunk_section, decode_layouts_section, dcp_decode_section, transport_section,
               planner_section, efficiency_section]
