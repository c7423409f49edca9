"""Figures (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import os
import statistics
from collections import defaultdict
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)


def _save(fig, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _series_label(row: dict[str, Any]) -> str:
    strategy = row.get("strategy")
    suffix = f" {strategy}" if strategy and strategy != "-" else ""
    return f"{row['system']} {row.get('layout', '')}{suffix}".strip()


def plot_prefill(rows: list[dict[str, Any]], path: str, title: str = "Prefill: time to first token") -> None:
    """TTFT (left) and prompt tokens/s (right) vs prompt length, one line per system/layout/strategy."""
    series: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        series[_series_label(row)].append(row)
    fig, (ax_t, ax_r) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, points in sorted(series.items()):
        points.sort(key=lambda r: r["prompt_tokens"])
        xs = [p["prompt_tokens"] for p in points]
        ax_t.plot(xs, [p["ttft_s"] for p in points], marker="o", label=label)
        ax_r.plot(xs, [p["tokens_per_s"] for p in points], marker="o", label=label)
    for ax, ylabel in ((ax_t, "TTFT (s)"), (ax_r, "prompt tokens / s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    ax_r.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    _save(fig, path)


def plot_decode(rows: list[dict[str, Any]], path: str, title: str = "Decode: output tokens/s") -> None:
    """Grouped bars: one group per (batch, context), one bar per system/layout (the median over rounds)."""
    groups = sorted({(r["batch_size"], r["context_tokens"]) for r in rows})
    labels = sorted({_series_label(r) for r in rows})
    width = 0.8 / max(len(labels), 1)
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(groups)), 4.5))
    for i, label in enumerate(labels):
        measured: dict[tuple[int, int], list[float]] = {}
        for r in rows:
            if _series_label(r) == label:
                measured.setdefault((r["batch_size"], r["context_tokens"]), []).append(r["tokens_per_s"])
        values = {point: statistics.median(speeds) for point, speeds in measured.items()}
        xs = [g + i * width for g in range(len(groups))]
        ax.bar(xs, [values.get(g, 0) for g in groups], width=width, label=label)
    ax.set_xticks([g + width * (len(labels) - 1) / 2 for g in range(len(groups))])
    ax.set_xticklabels([f"batch {b}\nctx {c}" for b, c in groups])
    ax.set_ylabel("output tokens / s (all requests)")
    ax.set_yscale("log")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title)
    fig.tight_layout()
    _save(fig, path)


def plot_serve(ttft_ms: list[float], tpot_ms: list[float], path: str, title: str = "Serving load") -> None:
    """Histograms of per-request TTFT and TPOT."""
    fig, (ax_a, ax_b) = plt.subplots(1, 2, figsize=(10, 4))
    ax_a.hist(ttft_ms, bins=20)
    ax_a.set_xlabel("TTFT (ms)")
    ax_b.hist(tpot_ms, bins=20)
    ax_b.set_xlabel("TPOT (ms)")
    for ax in (ax_a, ax_b):
        ax.set_ylabel("requests")
    fig.suptitle(title)
    fig.tight_layout()
    _save(fig, path)
