"""The section of docs/benchmarks.md on start-up (issue 27): the first two commands a user runs against the import
they cannot avoid, for an older commit and the working tree in the same rounds (benchmarks/startup.py,
startup.json)."""

from __future__ import annotations

from typing import Any

from report_sections import Results, _missing, md_table

TITLE = "## Start-up: `generate` and `serve` against the import (issue 27)"


def _intro(data: dict[str, Any]) -> str:
    before = f" and for commit `{data['before']}` (before the change), the two taking turns in every round" \
        if data.get("before") else ""
    return ("`benchmarks/startup.py` times, each in a fresh process, on the embedded SmolLM2 GGUF: `import` = `python "
            "-c \"import cpllm, torch, transformers\"` (the floor); `generate, cold` = `cpllm generate --prompt ... "
            "--max-tokens 8` with an empty tokenizer cache (a machine's first run: the GGUF's tokenizer is converted "
            "and stored); `generate, warm` = the same again; `serve, healthy` = `cpllm serve` until `GET /health` "
            f"answers 200. {data['rounds']} rounds for the working tree{before}; a figure is the median wall time, "
            "`x import` that median over the import's. Targets: a cold `generate` within 3x the import; the server "
            "healthy within 5 s of the import plus the model's load.")


def _rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    sides = data["sides"]
    rows = []
    for name in sides["after"]:
        row = {"command": name}
        for side in ("before", "after"):
            if side in sides:
                figure = sides[side][name]
                row[f"{side} s"] = figure["median_s"]
                row[f"{side} x import"] = figure["x_import"]
        if "before" in sides:
            row["after / before"] = f"{sides['after'][name]['median_s'] / sides['before'][name]['median_s']:.2f}"
        row["rounds, after (s)"] = ", ".join(map(str, sides["after"][name]["all_s"]))
        rows.append(row)
    return rows


def startup_section(results: Results, images: str, rel: str) -> list[str]:
    lines = [TITLE, ""]
    data = results.get("startup")
    if data is None:
        return lines + _missing("startup")
    return lines + [_intro(data), ""] + md_table(_rows(data)) + [
        "", f"Load average at the end: {data['machine']['load_average']}."]


STARTUP_SECTIONS = [startup_section]
