"""The section of docs/benchmarks.md on issue 26's benchmark: prompt-lookup speculative decoding on SmolLM2, from
benchmarks/spec_decode.py (one JSON per layout and batch: the copy and chat workloads in one run each)."""

from __future__ import annotations

import statistics
from typing import Any

from report_sections import Results, _missing, md_table

TITLE = "## Speculative decoding: prompt lookup on SmolLM2 (issue 26)"
INTRO = (
    "`benchmarks/spec_decode.py` (SmolLM2-135M-Instruct, its default GGUF weights and `quantization=auto`, greedy, "
    "chat template, prompt lookup with n from 4 down to 2): \"copy\" asks to rewrite a ~1.3K-token document (whole "
    "paragraphs of docs/architecture.md, then context_parallel.md and serve.md for the later requests of a batch) "
    "with one word changed, \"chat\" is a free-form question. One engine per k, all built up front and run in turn "
    "each round, so the machine's load reaches them alike; each request runs once per engine first, unmeasured, which "
    "also leaves its prompt in the prefix cache. Decode rate = output tokens after each request's first over the "
    "time from the first first token to the last end. A verify step emits its accepted drafts plus one, so "
    "`request steps` (output tokens after the first, less the drafts accepted) is the load-free measure of what "
    "speculation saves; `vs k=0` is the ratio of medians. `draft_length` is adaptive (each request's own limit, "
    "cut after a rejection and doubled back after a fully accepted step: docs/architecture.md) unless the table "
    "says fixed (always up to k, as vLLM drafts).")
FILES = (("spec_decode", "One rank, batch 1"), ("spec_decode_fixed", "One rank, batch 1, draft_length fixed"),
         ("spec_decode_pcp2", "PCP=2 (one thread per rank), batch 1"),
         ("spec_decode_batch16", "One rank, 16 requests at once"),
         ("spec_decode_batch16_fixed", "One rank, 16 requests at once, draft_length fixed"))
"""The result files of the section and the heading of each one's table."""


TIES = (
    "Where `same tokens as k=0` says NO, the first token that differs is a near-tie of the model, found by running "
    "the request alone with logprobs: the top two tokens 0.0006, 0.0008 and 0.002 nats apart (chat request 2 at "
    "output position 54, copy request 16 at 72, the PCP=2 chat at 105). A verify step's rows run through other "
    "kernels than a decode row (the grouped attention, PCP's merge over other pieces) and round differently in the "
    "last bits, and under `auto` the int4 layers quantize each row's activations to int8 codes, which can turn such "
    "a difference into one code step; a near-tie then goes either way. Token identity is what the tests check, in "
    "float32 on tiny models (tests/test_spec_decode*.py), on every layout.")


def _rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    rows, base = [], {}
    for run in data["runs"]:
        rounds = len(run["rates"])
        median = statistics.median(run["rates"])
        if run["k"] == 0:
            base[run["workload"]] = median
        accepted = run["accepted_tokens"] / rounds
        after_first = run.get("tokens_after_first", run["output_tokens"] - 1)
        rate = run["acceptance_rate"]
        per_verify = run["mean_accepted_per_verify"]
        rows.append({
            "workload": run["workload"], "prompt tokens": run["prompt_tokens"], "k": run["k"],
            "decode tok/s (median)": f"{median:.1f}", "vs k=0": f"{median / base[run['workload']]:.2f}",
            "acceptance": "-" if rate is None else f"{rate:.2f}",
            "accepted per verify step": "-" if per_verify is None else f"{per_verify:.2f}",
            "output tokens after the first": after_first, "request steps": f"{after_first - accepted:g}",
            "same tokens as k=0": "yes" if run["same_output"] else "NO",
            "rounds (tok/s)": ", ".join(f"{r:.1f}" for r in run["rates"])})
    return rows


def spec_section(results: Results, images: str, rel: str) -> list[str]:
    lines = [TITLE, "", INTRO, ""]
    for name, heading in FILES:
        data = results.get(name)
        if data is None and name.endswith("_fixed"):
            continue
        lines += [f"**{heading}** (`{name}.json`)", ""]
        if data is None:
            lines += _missing("spec") + [""]
            continue
        lines += md_table(_rows(data))
        lines += ["", f"Load average (1, 5, 15 min) at the end: {data['machine']['load_average']}.", ""]
    return lines + [TIES]


SPEC_SECTIONS = [spec_section]
