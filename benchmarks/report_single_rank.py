"""Sections of docs/benchmarks.md on one rank's speed (issue 10): its targets, the decode-step profile before and
after, and the quality of the approximate weight formats. Each is a function of the loaded results."""

from __future__ import annotations

from typing import Any

from report_cp import ratio_cell, round_ratios
from report_sections import Results, _missing, _model_config, md_table


def _ratio_rows(target: str, goal: str, pairs: list[tuple[str, float, float]]) -> list[dict[str, Any]]:
    if not pairs:
        return [{"target": target, "goal": goal, "measured": "not measured"}]
    return [{"target": target, "goal": goal,
             "measured": ", ".join(f"{label}: {a / b:.2f}" for label, a, b in pairs)}]


def _decode_pairs(decode: dict, system: str, other: str, batch: int, other_batch: int = 1):
    return [(f"{t}t/ctx {c}", row["tokens_per_s"], decode[(other, t, other_batch, c)]["tokens_per_s"])
            for (s, t, b, c), row in sorted(decode.items())
            if s == system and b == batch and (other, t, other_batch, c) in decode]


def _bound_pairs(compare: dict, decode: dict) -> list[tuple[str, float, float]]:
    config = _model_config()
    if config is None:
        return []
    from cpllm.bench.ceiling import weight_bytes_per_decode_step

    pairs = []
    for (s, t, b, c), row in sorted(decode.items()):
        ceiling = compare.get("ceilings", {}).get(str(t))
        if s == "cpllm" and b == 1 and ceiling:
            bound = ceiling["matvec_gbps"] * 1e9 / weight_bytes_per_decode_step(config)
            pairs.append((f"{t}t/ctx {c} (bound {bound:.1f} tok/s)", row["tokens_per_s"], bound))
    return pairs


def single_rank_targets_section(results: Results, images: str, rel: str) -> list[str]:
    lines = ["## One rank: targets (issue 10)", "",
             "Ratios from `compare.json` (every system measured in one run, interleaved, same threads). `cpllm` is "
             "`--quantization none` (fp32, the weights transformers runs), `cpllm (auto)` the GGUF's Q4_1 blocks as "
             "stored (the weights llama.cpp runs; on this CPU in cpllm's VNNI int4 kernel). Both run their batch-1 "
             "decode steps as one fused C call per layer (cpllm/model/execution/fused_decode.py), `auto` its 16-request steps "
             "too (float32 weights run fused up to 4 rows; bigger batches take the eager layers' MKL GEMM). "
             "`compiled` rows run decode with `--compile-decode` (warmed up on each graph variant before timing); "
             "the fused layers take precedence where they apply, so the compiled graphs run only the 16-request "
             "steps of `none`. `float16 KV` is `--kv-cache-dtype float16`, the format llama.cpp keeps K/V in. "
             "Decode requests of a batch share their prompt but the last token, and their first pass is a "
             "prefix-cache hit; each request's query reads its own slots of the shared context (the C decode "
             "kernel, which outruns the shared-key form here). Labels: total threads / context "
             "tokens (decode) or prompt tokens (prefill). Nothing here is asserted by tests.", ""]
    compare = results.get("compare")
    if not compare:
        return lines + _missing("compare")
    decode = {(r["system"], r["threads"], r["batch_size"], r["context_tokens"]): r for r in compare["decode"]}
    prefill = {(r["system"], r["threads"], r["prompt_tokens"]): r for r in compare["prefill"]}
    rows = _ratio_rows("auto batch-1 decode / llama.cpp, same file and threads", ">= 1.0",
                       _decode_pairs(decode, "cpllm (auto)", "llama.cpp", 1))
    rows += _ratio_rows("auto, --compile-decode, float16 K/V (as llama.cpp stores them) / llama.cpp", ">= 1.0",
                        _decode_pairs(decode, "cpllm (auto, compiled, float16 KV)", "llama.cpp", 1))
    rows += _ratio_rows("none batch-1 decode / transformers", ">= 1.3",
                        _decode_pairs(decode, "cpllm", "transformers", 1))
    rows += _ratio_rows("none, --compile-decode, batch-1 decode / transformers", ">= 1.3",
                        _decode_pairs(decode, "cpllm (compiled)", "transformers", 1))
    rows += _ratio_rows("none prefill / transformers (logits of the last position only, as its generate)",
                        ">= 1.0", [(f"{t}t/{n}", row["tokens_per_s"], prefill[("transformers", t, n)]["tokens_per_s"])
                                   for (s, t, n), row in sorted(prefill.items())
                                   if s == "cpllm" and ("transformers", t, n) in prefill])
    rows += _ratio_rows("none batch-1 decode / fp32 weight-streaming bound (`bench ceiling` matvec rate)", ">= 0.8",
                        _bound_pairs(compare, decode))
    for system in ("cpllm", "cpllm (auto)", "cpllm (compiled)", "cpllm (auto, compiled, float16 KV)"):
        rows += _ratio_rows(f"{system}: 16-request aggregate decode / transformers batch-1 decode", ">= 4",
                            _decode_pairs(decode, system, "transformers", 16, 1))
    rows.append({"target": "decode under PCP=2 and DCP=2 (1 thread per rank) / one rank with 2 threads",
                 "goal": ">= 1.0", "measured": _pcp_decode_cell(results)})
    return lines + md_table(rows)


def _pcp_decode_cell(results: Results) -> str:
    """PCP=2 (sharded) and TP=2 x DCP=2 over one rank with the same threads, per round (decode_pcp_sharded.json,
    issue 12's section; decode_dcp.json)."""
    data = results.get("decode_pcp_sharded")
    if not data:
        return "not measured in this run"
    try:
        by_point = round_ratios(data)
    except KeyError:  # no one-rank reference run in the file
        return "not measured in this run"
    cells = [f"PCP=2 batch {batch}/ctx {context}: {ratio_cell(ratios)}"
             for (layout, batch, context), ratios in by_point.items() if layout == "1x2x1@1"]
    dcp = results.get("decode_dcp")
    if dcp:
        cells += [f"TP=2 x DCP=2 batch {batch}/ctx {context}: {ratio_cell(ratios)}"
                  for (layout, batch, context), ratios in round_ratios(dcp).items() if layout == "2x1x2@1"]
    return ", ".join(cells) + " (decode_pcp_sharded.json; DCP on a one-KV-head model of SmolLM2's shape, " \
        "decode_dcp.json: SmolLM2's 9 query / 3 KV heads allow no TP that DCP=2 can divide)"


def decode_profile_section(results: Results, images: str, rel: str) -> list[str]:
    lines = ["## One rank: where a decode step goes, before and after", ""]
    data = results.get("decode_profile")
    if not data:
        return lines + _missing("") + ["(`python benchmarks/profile_before_after.py --before REV`)"]
    w, argv = data["workload"], data.get("argv", [])
    before = data.get("before_rev") or (argv[argv.index("--before") + 1] if "--before" in argv else "?")
    after = data.get("after_rev", "the working tree")
    lines += [f"`benchmarks/profile_before_after.py`: `{before}` against `{after}`, alternating "
              f"processes in one run; SmolLM2, quantization={w['quantization']}, batch {w['batch']}, context "
              f"{w['context']}, {w['threads']} threads, {w['steps']} steps under torch.profiler (self CPU time per "
              "step; the profiler adds its own overhead). Step time measured without the profiler: median of each "
              "run, and the best round. cpllm's C kernels (the int4 matmul, decode attention, the fused decode "
              "layers) are called through ctypes, not as torch operators: their time is in the step but not in "
              "the operator table, which shows what is left around them.", ""]
    summary = [{"": side, "step_ms (median per run)": ", ".join(str(x) for x in data[side]["step_ms"]),
                "best_step_ms": data[side]["best_step_ms"], "aten calls/step": data[side]["aten_calls_per_step"]}
               for side in ("before", "after")]
    lines += md_table(summary) + [""]
    spread = max(max(data[s]["step_ms"]) / min(data[s]["step_ms"]) for s in ("before", "after"))
    if spread > 1.25:  # the same code measured twice disagrees: the load moved under the run
        lines += [f"> Runs of the same side differ by up to {spread:.1f}x here: the machine's load changed during "
                  "this run, so its times compare poorly; the call counts do not depend on load.", ""]
    before = {r["op"]: r for r in data["before"]["ops"]}
    after = {r["op"]: r for r in data["after"]["ops"]}
    ops = list(dict.fromkeys([*before, *after]))
    rows = [{"op": op,
             "before ms/step": before[op]["self_ms_per_step"] if op in before else "",
             "before calls": before[op]["calls_per_step"] if op in before else "",
             "after ms/step": after[op]["self_ms_per_step"] if op in after else "",
             "after calls": after[op]["calls_per_step"] if op in after else ""} for op in ops]
    return lines + md_table(rows) + ["", "(an empty cell: not among that side's top operators)"]


def quality_section(results: Results, images: str, rel: str) -> list[str]:
    lines = ["## Quality of the approximate formats", ""]
    data = results.get("quality")
    if not data:
        return lines + _missing("") + ["(`python benchmarks/quality.py`)"]
    lines += [f"`benchmarks/quality.py`: {data['rows'][0]['prompts']} chat prompts, {data['max_tokens']} greedy "
              "tokens each (EOS ignored), compared with cpllm `none` (fp32) token by token: `identical_completions`, "
              "and `agreement`, the mean share of each completion before its first differing token. Then the "
              f"log-likelihood of a fixed {data['text_tokens']}-token English text: mean per-token log-probability, "
              "its mean (signed and absolute) difference from `none` on the same token ids, and perplexity. "
              "`int8` and `int4` quantize float-stored linear weights at load and run GGUF blocks as stored "
              "(cpllm/model/formats/plan.py): on this file, whose every linear is Q4_1, they run the same int4 "
              "blocks as `auto` and differ from it only in the LM head, which they keep in float32 where `auto` "
              "runs the tied Q8_0 rows in the int8 kernel and recomputes each row's best 16 logits exactly.", ""]
    for note in data.get("notes", []):
        lines += [f"> {note}", ""]
    return lines + md_table(data["rows"])


def _kernel_bench_section(results: Results, title: str, key: str, description: str) -> list[str]:
    """A kernel benchmark's section: `description` (its prose), the load when it started, its result table."""
    lines = [f"## {title}", ""]
    data = results.get(key)
    if not data:
        return lines + _missing("") + [f"(`python benchmarks/{key}.py`)"]
    lines += [f"{description} Load average at the start: {data['machine'].get('load_average')}.", ""]
    return lines + md_table(data["results"])


def decode_attention_section(results: Results, images: str, rel: str) -> list[str]:
    return _kernel_bench_section(
        results, "Decode attention: the in-place kernel against gather + flash", "decode_attention",
        "`benchmarks/decode_attention.py`: one decode token's attention over its context for all 30 layers "
        "of SmolLM2's shapes (9 query heads, 3 KV heads of 64), the context in 16-slot blocks scattered over "
        "the pool, one pool pair per layer (read from memory, not cache). `kernel_ms`: the C kernel reading "
        "the slots in place (cpllm/kernels/decode_attention.c); `gather_flash_ms`: the path it replaced and "
        "the fallback without a compiler (index_select of the slots, widened to float32, PyTorch's CPU flash "
        "kernel). Both through the engine's `attend_decode`, alternating in rounds, median round; "
        "`kernel_gb_per_s` is the K/V bytes over the kernel's time.")


def prefill_attention_section(results: Results, images: str, rel: str) -> list[str]:
    return _kernel_bench_section(
        results, "Prefill attention: cpllm's kernel against PyTorch's flash kernel", "prefill_attention",
        "`benchmarks/prefill_attention.py`: one layer's causal attention of a prompt over itself, q read in place "
        "inside the fused q|k|v rows, for SmolLM2's heads (9 query, 3 KV of 64) and the MoE benchmark's (16 "
        "query, 4 KV of 64). `kernel_ms`: cpllm/kernels/prefill_attention.c (tiles of 64 (position, query head) "
        "rows of one KV head, everything transposed so the online softmax runs lane-wise, each key and value "
        "element broadcast once per tile); `torch_flash_ms`: PyTorch's CPU flash kernel, which transformers' sdpa "
        "path also runs and which cpllm falls back to. Both through the engine's `attend`, alternating in "
        "rounds, median round; `gflops` counts the multiply-adds over the visible half of the score matrix.")


def int4_kernel_section(results: Results, images: str, rel: str) -> list[str]:
    return _kernel_bench_section(
        results, "The int4 matmul: cpllm's VNNI kernel against aten's", "int4_kernel",
        "`benchmarks/int4_kernel.py`: SmolLM2's four linear layers (q|k|v, o, gate|up, down) for 30 layers, each "
        "with its own random 4-bit groups (streamed from memory), through `Int4Linear` built for each backend: "
        "`vnni` (cpllm/kernels/int4_matmul.c: activations held as two int8 codes per group of 32, integer dot "
        "products with `vpdpbusd`) and `aten` (`_weight_int4pack_mm_for_cpu`, bfloat16 activations). `rows`: 1 "
        "is a batch-1 decode step, 16 a 16-request step, 512 a prefill chunk. `error`: the first layer's output "
        "against float64 on the same dequantized weights (relative norm). Alternating rounds, median round.")


SINGLE_RANK_SECTIONS = [single_rank_targets_section, decode_profile_section, decode_attention_section,
                        prefill_attention_section, int4_kernel_section, quality_section]
