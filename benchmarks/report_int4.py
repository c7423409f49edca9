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



TILES_INTRO = (
    "On a CPU with AVX-512 BF16 the default path (`auto`: the GGUF's int4 weights as stored) now prefills on bf16 "
    "dot products: the int4 layers' many-row calls dequantize weight tiles to bfloat16 for oneDNN's bf16 GEMM "
    "(cpllm/kernels/int4_gemm.py, the dtype and threshold measured at start-up), and prefill attention runs the "
    "bf16 variant of cpllm's kernel (float32 scores, softmax, output and log-sum-exp). Decode keeps the VNNI "
    "integer kernel. `--quantization none` keeps float32 everywhere.")


def _prefill_by(compare: dict[str, Any]) -> dict[tuple[str, int, int], dict[str, Any]]:
    return {(row["system"], row["threads"], row["prompt_tokens"]): row for row in compare["prefill"]}


def _target_rows(compare: dict[str, Any], ceiling: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Default-path prefill against transformers bf16 and llama.cpp, and its share of the bf16 matmul rate."""
    by = _prefill_by(compare)
    bf16_rate = {row["threads"]: row.get("bf16_matmul_gflops") for row in (ceiling or {}).get("results", [])}
    rows = []
    for (system, threads, tokens), row in sorted(by.items(), key=lambda item: (item[0][1], item[0][2])):
        if system != "cpllm (auto)":
            continue
        out = {"threads": threads, "prompt tokens": tokens, "cpllm auto tok/s": row["tokens_per_s"]}
        for other, label in (("transformers (bfloat16)", "vs transformers bf16"), ("transformers", "vs transformers fp32"),
                             ("llama.cpp", "vs llama.cpp")):
            theirs = by.get((other, threads, tokens))
            out[label] = round(row["tokens_per_s"] / theirs["tokens_per_s"], 2) if theirs else "not run"
        rate = bf16_rate.get(threads)
        out["useful GFLOP/s"] = row["gflops"]
        out["of bf16 matmul rate"] = round(row["gflops"] / rate, 2) if rate else "not measured"
        rows.append(out)
    return rows


def _quality_2048(quality: dict[str, Any]) -> list[dict[str, Any]]:
    """quality.py's rows: greedy agreement with `none` and the logprob differences, over the chat prompts and over a
    2,048-token text."""
    return [{k: row.get(k) for k in ("system", "identical_completions", "agreement", "mean_abs_logprob_diff",
                                     "mean_abs_logprob_diff_2048", "max_abs_logprob_diff_2048")}
            for row in quality["rows"]]


def tiles_section(results: Results, images: str, rel: str) -> list[str]:
    lines = ["## Default prefill on bf16 dot products (issue 43, AVX-512 BF16)", "", TILES_INTRO, ""]
    compare, before_after = results.get("compare_bf16"), results.get("int4_bf16")
    if compare is None:
        return lines + _missing("compare_bf16")
    machine = (before_after or compare)["machine"]
    lines += [f"Machine: {_flags(machine)}. Load average at start {machine.get('load_average_start')}.", "",
              "Targets: benchmarks/compare.py, one process per system, the same random prompt, LM head on the last "
              "position only, fastest of the rounds; the bf16 matmul rate is `cpllm bench ceiling` (a side of 1,024) "
              "on the same thread count.", ""]
    lines += md_table(_target_rows(compare, results.get("ceiling_bf16")))
    if before_after is not None:
        lines += ["", f"Before and after (benchmarks/int4_before_after.py --before {before_after['before']}: each "
                  f"side's compare.py and PCP=2 `cpllm bench prefill` in turn, {before_after['rounds']} rounds, "
                  f"{before_after['threads']} thread per rank):", ""]
        lines += md_table(_rows(before_after))
        lines += ["", "TTFT rows are seconds and efficiency rows TTFT(1 rank) / (2 TTFT(PCP=2)). The one-rank 4K prefill "
                  "got 1.55x faster and PCP=2's 1.34x: what PCP does not divide (each step's Python and scheduling, "
                  "the collectives, the LM head's last rows) is now a larger share of a faster step, so the "
                  "efficiency target (>= 0.95) is missed on these weights. Decode runs the same fused VNNI layers on "
                  "both sides: read it by `vs none`, measured moments apart in the same process."]
        if before_after.get("note"):
            lines += ["", f"Note: {before_after['note']}."]
    quiet = results.get("int4_bf16_quiet")
    if quiet is not None:
        lines += ["", f"Again without the PCP runs, on a quiet machine (load average {quiet['machine']['load_average_start']} "
                  f"at start, {quiet['machine']['load_average_end']} at end): decode within its rounds' spread, "
                  "prefill faster.", ""]
        lines += md_table(_rows(quiet))
    quality = results.get("quality_bf16")
    if quality is not None:
        lines += ["", "Quality against `none` (benchmarks/quality.py; the last two columns over a 2,048-token text, "
                  "where the bf16 GEMMs and attention run):", ""]
        lines += ["", "The 8 chat prompts are generated in one call: their first step holds about 280 rows, past the "
                  "bf16 GEMMs' threshold, so their first tokens ran in bf16 and one completion of 48 tokens parted "
                  "from `none`'s; each scored text runs alone.", ""]
        lines += md_table(_quality_2048(quality))
    for source in (compare, before_after or {}, quality or {}):
        for note in source.get("notes", []):
            lines += ["", f"Note: {note}."]
    return lines


PCP_INTRO = (
    "benchmarks/pcp_efficiency.py: SmolLM2 on the default weights (`auto`), a fresh 4,096-token prompt, one thread per "
    "rank; each layout built once, warmed up, fastest of 3 prompts. The sides take turns in each round: `after` is "
    "this tree (prefill attention with a causal offset, cpllm/context_parallel/partition.py `joined_key_runs`: a run "
    "and the keys before it in one kernel call, the first partial written instead of merged), `before` its parent "
    "9cc9d68 on the same venv (`PYTHONPATH`). Efficiency is TTFT(1 rank) / (2 TTFT(PCP=2)); `cpu ratio` the same of "
    "the CPU seconds of every engine process (user + system, /proc), which waiting does not inflate.")


def _pcp_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for side in data["sides"]:
        one = side["results"][0]
        for row in side["results"][1:]:
            rows.append({"round": side["round"], "side": side["side"], "strategy": row["strategy"],
                         "ttft 1 rank s": one["ttft_s"], "ttft PCP=2 s": row["ttft_s"],
                         "efficiency": row["efficiency"], "cpu ratio": row["cpu_ratio"],
                         "load at start": side["machine"].get("load_average_start")})
    return rows


def pcp_section(results: Results, images: str, rel: str) -> list[str]:
    lines = ["### PCP=2 efficiency on the default weights at 4K tokens (issue 43, session 18)", "", PCP_INTRO, ""]
    data = results.get("pcp_efficiency")
    if data is None:
        return lines + _missing("pcp_efficiency")
    machine = data["sides"][0]["machine"]
    lines += [f"Machine: {machine.get('cpu')} ({machine.get('cpu_family_model')}, Zen 4), {machine.get('cores')} "
              "cores, AVX-512 BF16 and VNNI, no AMX; `cpllm bench ceiling` on it: 92 GFLOP/s float32 and 209 GFLOP/s "
              "bf16 on one thread, half the bf16 rate of the machine of the tables above (429).", ""]
    lines += md_table(_pcp_rows(data))
    lines += ["", "The one-rank time drifted by 13% over the ten minutes (8.6 s to 9.8 s, the same code), so read the "
              "PCP=2 rows side by side: the ring's TTFT is 0.95x before's in both rounds (4.62 s against 4.84 s and "
              "4.83 s), the all-gather's unchanged within its spread. The ring's efficiency is 0.93 and 1.01 after, "
              "mean 0.97 (0.91 and 0.99 before, mean 0.95): the 0.95 target is met on average on this machine, "
              "whose slower bf16 GEMMs leave the fixed costs a smaller share; on the faster machine above the code "
              "before this change measured 0.82, and this change was not measured there."]
    return lines


AMX_INTRO = (
    "On a CPU with AMX (an Intel Xeon of the Sapphire Rapids kind) the same default path runs on its tiles: oneDNN "
    "runs the int4 layers' bf16 GEMMs (weight tiles dequantized per call, cpllm/kernels/int4_gemm.py) on AMX, and "
    "prefill attention takes the kernel's AMX way (cpllm/kernels/prefill_attention.c, tdpbf16ps for both products), "
    "chosen at start-up over vdpbf16ps, which measured slower than float32 on this core. Decode keeps the VNNI "
    "integer kernel. llama.cpp (llama-cpp-python 0.3.36) was built for this CPU's AVX-512 (F, VNNI, BF16, VBMI) "
    "with its AMX code off: built with `GGML_NATIVE=ON` its AMX int8 matmul (`ggml_backend_amx_mul_mat`) "
    "segfaulted on this Q4_1 file at every batch above one token.")


def _attention_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"prompt tokens": row["prompt_tokens"], "system": row["system"], "ms": row["ms"],
             "GFLOP/s": row["gflops"]} for row in data["results"]]


def _pcp_layout(row: dict[str, Any]) -> str:
    if row["pcp"] == 1:
        return "one rank"
    if row["pcp"] == 2:
        ran = row.get("ran", {})
        if row["strategy"] == "auto" and ran:  # what auto chose for these prompts
            return f"PCP=2 (auto: {', '.join(sorted(ran))})"
        return f"PCP=2 ({row['strategy']})"
    return "two one-rank engines at once (the bound)"


def amx_section(results: Results, images: str, rel: str) -> list[str]:
    lines = ["## Default prefill on AMX tiles (issue 43, Intel Xeon with AMX)", "", AMX_INTRO, ""]
    compare, before_after = results.get("compare_amx"), results.get("int4_amx")
    if compare is None:
        return lines + _missing("compare_amx")
    machine = (before_after or compare)["machine"]
    said = _flags(machine) if "cpu_flags" in machine else f"{machine.get('cpu')}, {machine.get('cores')} cores"
    lines += [f"Machine: {said}. Load average at start {compare['machine'].get('load_average_start')}.",
              "", "Targets: benchmarks/compare.py as above (one process, the systems in turn, fastest of 2 rounds); "
              "the bf16 matmul rate is `cpllm bench ceiling` on the same thread count (ceiling_amx.json).", ""]
    lines += md_table(_target_rows(compare, results.get("ceiling_amx")))
    ceiling = results.get("ceiling_amx")
    if ceiling is not None:
        one = next((row.get("bf16_matmul_gflops") for row in ceiling["results"] if row["threads"] == 1), None)
        doubled = [f"{row['useful GFLOP/s'] / (2 * one):.2f}" for row in _target_rows(compare, ceiling)
                   if row["threads"] == 2] if one else []
        lines += ["", "This machine's matmul rates (`cpllm bench ceiling`; bf16 and int8 at a side of 1,024, which "
                  "is too small to keep two cores' tiles busy: the 2-thread bf16 rate comes out barely above one "
                  "thread's, so the 2-thread rows' fractions above overstate; against twice the one-thread rate they "
                  f"are {' and '.join(doubled) or 'not measured'}):", ""] + md_table(ceiling["results"])
    lines += ["", "Where a 2,048-token prefill on one core goes now (cProfile and torch.profiler, 1 thread, 1.13 s "
              "that run): prefill attention 369 ms (the AMX way at ~390 GFLOP/s in the engine: with the softmax left "
              "out the tile work alone ran at ~660, with the tiles left out the softmax alone ~720, and the two barely "
              "overlap), the bf16 GEMMs 418 ms (~1,040 GFLOP/s; the same shapes alone reach 1,250-1,470, and any "
              "heavy call before one, even another GEMM, slows it to 750-900: its operands come back from beyond the "
              "2 MiB L2), and about 300 ms of passes over the activations that run at the memory's ~11-15 GB/s on "
              "one core (silu·up 82, casts 66, norms 55, weight dequantization 39, rotary 23, K/V store 21, residual "
              "20 ms). Since the first AMX measurement (0.49 of a 1,077 GFLOP/s reading): bf16 between the GEMMs "
              "(the same bits; casts 240 -> ~50 ms), the layout changes around the attention's tiles as 16 x 16 "
              "transposes, blocks of 128 keys on the tiles (64 before: the accumulators' tile loads and stores paid "
              "half as often, 5-10% of the attention at 2K), and q|k|v widened and rotated in one pass (1.05 -> "
              "0.77 ms a layer alone). Tried and not kept: a one-pass softmax, the next block's scores issued during "
              "this block's softmax, a degree-4 exp2, a reciprocal in silu (memory-bound: no gain), a kept "
              "dequantization scratch and huge pages (THP_MEM_ALLOC_ENABLE: within noise). The 0.6 target needs the "
              "attention about twice as fast and the activation passes halved; this machine's own bf16 rate reads "
              "635-1,450 GFLOP/s from one run of `cpllm bench ceiling` to the next (a side of 1,024, best of 2), "
              "so the fraction in the table moves with it."]
    for name, title in (("attention_ways", "after"), ("attention_ways_before", "before: 704c467, the first AMX way")):
        data = results.get(name)
        if data is not None:
            lines += ["", f"Prefill attention alone, SmolLM2's heads, one thread (benchmarks/prefill_attention_ways.py, "
                      f"{title}):", ""] + md_table(_attention_rows(data))
    pcp = results.get("pcp_efficiency_amx")
    if pcp is not None:
        rows = [{"layout": _pcp_layout(row), "ttft s": row["ttft_s"],
                 "rounds s": ", ".join(str(run["wall_s"]) for run in row["runs"]),
                 "efficiency": row.get("efficiency", row.get("bound_on_efficiency", "")),
                 "cpu ratio": row.get("cpu_ratio", "")}
                for row in pcp["results"]]
        lines += ["", f"PCP=2 on the default weights at {pcp['results'][0]['tokens']} tokens, one thread per rank "
                  "(benchmarks/pcp_efficiency.py):", ""] + md_table(rows)
        lines += ["", "The one rank's rounds alternate with each PCP=2 strategy's on the same prompts, and each "
                  "efficiency is read against the one rank's fastest round of its block. `auto` now takes the "
                  "all-gather for a fresh prompt on one CPU host (the cost model's CPU spec all-gathers through "
                  "shared memory and counts the ring's second call and merge, context_parallel.md \"`auto`\"), and "
                  "the all-gather path changed three ways: each PCP rank attends its head and tail runs in one kernel "
                  "call with a causal offset per query row (no merge, no copy into the step's rows, K/V packed once), "
                  "the prompt's new K/V are gathered straight into position order in shared memory (every rank writes "
                  "its runs at their positions; no concatenation, no reordering copy), and a rank holding fewer tokens "
                  "keeps the one call. Before these, `auto` ran the ring at 0.80 here (0.80-0.82 last session) and the "
                  "all-gather reached 0.82-0.84. What PCP=2 still misses of 0.95: per-call costs that do not halve "
                  "with the rows (each GEMM's cold operands, the weights' dequantization, 46 ms a prefill on every "
                  "rank), the K/V written into shared memory, and a busier memory with both cores streaming. The "
                  "two-engines row (`--concurrent`) bounds any two-rank layout on this machine."]
    if before_after is not None:
        rounds = before_after["rounds"]
        lines += ["", f"Before and after (benchmarks/int4_before_after.py --before {before_after['before']}, "
                  f"{rounds} round{'s' * (rounds > 1)}, {before_after['threads']} thread; the sides take turns going "
                  "first, each figure the median of its side's rounds):", ""]
        lines += md_table(_rows(before_after))
        lines += ["", "Decode runs the same VNNI integer kernel and fused decode layers on both sides (the issue's "
                  "work touched prefill only), so its after / before is this machine's drift between the sides, as "
                  "for `none` and transformers, whose decode did not change either; `auto` against `none` in the same "
                  "process (the last two columns) is the figure to read."]
    quality = results.get("quality_amx")
    if quality is not None:
        lines += ["", "Quality against `none` (benchmarks/quality.py; the last two columns over a 2,048-token text):",
                  ""]
        lines += md_table(_quality_2048(quality))
    return lines


INT4_SECTIONS = [int4_section, tiles_section, pcp_section, amx_section]
