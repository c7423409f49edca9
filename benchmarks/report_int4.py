"""The section of docs/benchmarks.md on issue 43 on a CPU without AVX-512: the default path (`auto`, int4 weights as
stored) before and after the AVX2 int4 kernel, from benchmarks/int4_before_after.py (int4_avx2.json), and the
machine's bf16 and int8 matmul rates from `cpllm bench ceiling` (ceiling_low_precision.json)."""

from __future__ import annotations

from typing import Any

from report_sections import Results, _missing, md_table

INTRO = (
    "`benchmarks/int4_before_after.py --before 94865ab --after <commit>` runs benchmarks/compare.py of each side in "
    "its own process, the sides taking turns going first in each round: prefill of a 2,048-token prompt and decode at "
    "batch 1 and 16 (128-token context) of cpllm `auto` (the GGUF's Q4_1 / Q8_0 weights as stored), cpllm `none` "
    "(float32) and transformers (float32), all on the same thread count. A figure is the median over the rounds of "
    "a side; `after / before` is that of the medians, and `vs none` is `auto` against `none` of the same side. "
    "Before, this CPU ran the int4 layers in aten's int4 kernel (bfloat16 activations); after, in "
    "cpllm/kernels/int4_avx2.c (decode) and float32 GEMMs on weight tiles dequantized per call (prefill).")

CPU_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")
"""The flags the int4 kernel choice reads, shown as present or absent."""


def _flags(machine: dict[str, Any]) -> str:
    """The CPU and the flags of CPU_FLAGS it had when measured (int4_before_after.py records them)."""
    flags = set(machine.get("cpu_flags", []))
    said = ", ".join(f"{flag} {'yes' if flag in flags else 'no'}" for flag in CPU_FLAGS)
    return f"{machine.get('cpu', '?')}, {machine.get('cores', '?')} cores; {said}"


def _rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"figure (tokens/s)": row["figure"], "before": row["before"], "after": row["after"],
             "after / before": row["ratio"], "vs none, before": row["before_vs_none"] or "",
             "vs none, after": row["after_vs_none"] or "",
             "rounds (before; after)": ", ".join(map(str, row["before_all"] or [])) + "; "
             + ", ".join(map(str, row["after_all"] or []))} for row in data["rows"]]


def _quality(data: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for side, result in data.get("quality", {}).items():
        for row in result.get("rows", []):
            if row["system"] != "cpllm (none)":
                rows.append({"side": side, "system": row["system"], "identical completions":
                             f"{row['identical_completions']} of {row['prompts']}", "agreement": row["agreement"],
                             "mean abs logprob diff": row["mean_abs_logprob_diff"]})
    return rows


def int4_section(results: Results, images: str, rel: str) -> list[str]:
    lines = ["## The int4 default path without AVX-512 (issue 43): before and after", "", INTRO, ""]
    data = results.get("int4_avx2")
    if data is None:
        return lines + _missing("int4_avx2")
    lines += [f"Machine: {_flags(data['machine'])}. {data['threads']} thread(s) per system, {data['rounds']} rounds; "
              f"load average at start {data['machine']['load_average_start']}, at end "
              f"{data['machine']['load_average_end']} (the 2 cores were shared with other work).", ""]
    lines += md_table(_rows(data))
    lines += ["", "transformers runs the same code on both sides, so its after / before ratio is how far the machine's "
              "load moved between the sides' runs; `vs none` (auto against float32 in the same process, moments "
              "apart) is the figure to read."]
    if data.get("note"):
        lines += ["", f"Note: {data['note']}."]
    quality = _quality(data)
    if quality:
        lines += ["", "Greedy agreement with `none` (benchmarks/quality.py of each side):", ""] + md_table(quality)
    ceiling = results.get("ceiling_low_precision")
    if ceiling is not None:
        lines += ["", "This machine's matmul rates (`cpllm bench ceiling`; bf16 and int8 at a side of 1,024, "
                  "float32 at 2,048): without AVX-512 BF16, VNNI or AMX, bfloat16 and int8 matmuls run far below "
                  "float32, so float32 GEMMs are this CPU's fastest tiles for a prefill.", ""]
        lines += md_table(ceiling["results"])
        if ceiling.get("note"):
            lines += ["", f"Note: {ceiling['note']}."]
    return lines


INT4_SECTIONS = [int4_section]
