"""The section of docs/benchmarks.md on issue 24's structural change: the figures it must not move, before and
after, from benchmarks/structure_before_after.py (structure.json, and structure_tp_team.json where the TP-team case
was run again with more rounds)."""

from __future__ import annotations

from typing import Any

from report_sections import Results, _missing, md_table

INTRO = (
    "`benchmarks/structure_before_after.py --before 45527f0` runs each case below as its own bench process for the "
    "commit before the change and for the working tree after it, the two sides taking turns in every round (the "
    "side that goes first alternates). A figure is the median over the rounds; `after / before` is that of the "
    "medians (decode: tokens/s, higher is better; TTFT: seconds, lower is better). Decode on one rank is the SmolLM2 "
    "GGUF at a 128-token context, `1x1x1@2`; the PCP team is `1x2x1@1` with a 2,048-token shared prefix; the TP "
    "team is benchmarks/dcp_decode.py's one-KV-head model, TP=2 without and with DCP=2, one thread per rank.")


def _rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for row in data["rows"]:
        point = (row["point"].replace("layout=", "").replace(" strategy=-", "").replace("batch_size=", "batch ")
                 .replace("context_tokens=", "ctx ").replace("prompt_tokens=", "prompt "))
        rows.append({"case": row["case"], "point": point, "metric": row["metric"], "before": round(row["before"], 3),
                     "after": round(row["after"], 3), "after / before": f"{row['ratio']:.3f}",
                     "rounds (before; after)": ", ".join(map(str, row["before_all"])) + "; "
                     + ", ".join(map(str, row["after_all"]))})
    return rows


def _outside_noise(data: dict[str, Any]) -> list[str]:
    """The rows beyond +-5%, each said as slower or faster (TTFT: a ratio below 1 is faster)."""
    said = []
    for row in data["rows"]:
        faster = row["ratio"] > 1 if row["metric"] == "tokens_per_s" else row["ratio"] < 1
        if abs(row["ratio"] - 1) > 0.05:
            said.append(f"{row['case']}, {row['point']}: {row['ratio']:.3f} ({'faster' if faster else 'slower'})")
    return said


def structure_section(results: Results, images: str, rel: str) -> list[str]:
    lines = ["## The structure change (issue 24): before and after", "", INTRO, ""]
    data = results.get("structure")
    if data is None:
        return lines + _missing("structure")
    load = data["machine"]["load_average"]
    lines += md_table(_rows(data)) + ["", f"{data['rounds']} rounds; load average at the end: {load}."]
    outside = _outside_noise(data)
    lines += ["", "Beyond +-5%: " + ("; ".join(outside) if outside else "none") + "."]
    again = results.get("structure_tp_team")
    if again is not None:
        lines += ["", f"The TP-team case again, {again['rounds']} more rounds in a separate run:", ""]
        outside = _outside_noise(again)
        lines += md_table(_rows(again)) + ["", "Beyond +-5%: " + ("; ".join(outside) if outside else "none") + ".",
                                           "", f"Load average at the end: {again['machine']['load_average']}."]
    return lines


STRUCTURE_SECTIONS = [structure_section]
