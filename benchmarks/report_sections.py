"""The sections of docs/benchmarks.md, each a function of the loaded results returning markdown lines."""

from __future__ import annotations

import os
from typing import Any

Results = dict[str, dict[str, Any]]


def md_table(rows: list[dict[str, Any]], columns: list[str] | None = None) -> list[str]:
    if not rows:
        return ["(no rows)"]
    columns = columns or [k for k, v in rows[0].items() if not isinstance(v, (list, dict))]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join("" if row.get(c) is None else str(row.get(c)) for c in columns) + " |")
    return lines


def _missing(name: str) -> list[str]:
    return [f"_No results yet: run `benchmarks/run_all.sh{' ' + name if name else ''}`._"]


def _fmt(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


# ---- machine and commands -----------------------------------------------------------------------------

def machine_section(results: Results, images: str, rel: str) -> list[str]:
    lines = ["## Machine and versions", ""]
    if not results:
        return lines + _missing("")
    for key in ("cpu", "cores", "platform", "python", "torch", "transformers", "llama_cpp"):
        # a package installed between two runs shows up in the later files only
        value = next((d["machine"][key] for d in results.values() if d.get("machine", {}).get(key) is not None),
                     None)
        lines.append(f"- {key}: {value if value is not None else 'not installed'}")
    lines += ["", "Load average (1, 5, 15 min) when each result was started and written; the machine is shared, so "
              "compare only numbers from the same file (they were measured side by side, interleaved)."]
    def loads(machine: dict[str, Any], key: str) -> str | None:
        return " / ".join(str(x) for x in machine[key]) if machine.get(key) else None

    lines += ["On two cores, every other busy process slows a 2-thread run far more than a 1-thread one "
              "(OpenMP threads spin-wait for each other), so 2-thread figures are the most fragile; prefill "
              "reports the fastest of its repeats (other load only ever adds time) next to the median.", ""]
    rows = [{"result": name, "load_at_start": loads(data["machine"], "load_average_start"),
             "load_at_end": loads(data["machine"], "load_average_end") or loads(data["machine"], "load_average")}
            for name, data in results.items() if "machine" in data]  # a file without one has no load to show
    return lines + md_table(rows)


def commands_section(results: Results, images: str, rel: str) -> list[str]:
    lines = ["## Commands", "", "Each result file and the command that wrote it:", "", "```"]
    for name, data in results.items():
        argv = data.get("argv")
        if data.get("command") == "compare":
            argv = ["python", "benchmarks/compare.py", *(argv or [])]
        lines.append(f"# {name}.json")
        lines.append(" ".join(argv) if argv else "(command not recorded)")
    return lines + ["```"]


def usage_section(results: Results, images: str, rel: str) -> list[str]:
    return ["## The bench commands", "", "```",
            "cpllm bench prefill --model M --lengths 1024,2048 --layouts 1x1x1@1,1x1x1@2,1x2x1@1 \\",
            "    --strategies allgather,ring --repeats 3 --json out.json --plot out.png",
            "cpllm bench decode --layouts 1x1x1@2 --batch-sizes 1,16 --context-lengths 128,2048 [--shared-prefix] [--rounds 5]",
            "cpllm bench serve [--url http://127.0.0.1:8000] --num-requests 32 --concurrency 8 \\",
            "    --prompt-tokens 256 --output-tokens 64      # without --url it starts `cpllm serve` itself",
            "cpllm bench memory --cp-sizes 1,2,4 --budget 64MiB",
            "cpllm bench comm --lengths 2048,8000 -pcp 2",
            "cpllm bench ceiling --threads 1,2",
            "python benchmarks/compare.py --threads 1,2      # cpllm vs transformers vs llama.cpp",
            "python benchmarks/dcp_decode.py --rounds 5      # DCP=2 (with TP=2) on a one-KV-head SmolLM2 shape",
            "```", "",
            "A layout is `TPxPCPxDCP`, optionally `@threads_per_rank`; without it the threads come from "
            "`--threads-per-rank`, else the cores are shared out evenly. Always give threads explicitly: with more "
            "busy threads than cores, OpenMP spin-waiting makes small ops very slow. Each command prints a table "
            "and, with `--json`, writes the rows plus the machine (CPU, cores, load average, versions); every engine "
            "flag of `cpllm generate` is accepted (e.g. `--model`, `--block-size`, `--kv-cache-memory-bytes`). "
            "`bench decode --rounds N` runs every layout N times in rotated order, so that layouts compared with "
            "each other are measured close together in time (compare them within a round)."]


# ---- targets ------------------------------------------------------------------------------------------

def _model_config():
    try:
        from cpllm.bench.engines import model_config_of

        return model_config_of(None)
    except Exception:  # the default model is not installed: the decode bound is left out
        return None


def targets_section(results: Results, images: str, rel: str) -> list[str]:
    rows: list[dict[str, Any]] = []
    pcp = results.get("prefill_pcp")
    if pcp:
        longest = max(r["prompt_tokens"] for r in pcp["efficiency"])
        best = max((r for r in pcp["efficiency"] if r["prompt_tokens"] == longest and r["efficiency"]),
                   key=lambda r: r["efficiency"], default=None)
        if best:
            rows.append({"target": f"PCP=2 (1 thread/rank) parallel efficiency at {longest} tokens", "goal": ">= 0.95",
                         "measured": f"{best['efficiency']} ({best['strategy']})"})
            rows.append({"target": f"PCP=2 (1 thread/rank) speed-up over 1 rank with 2 threads, {longest} tokens",
                         "goal": "(reported)", "measured": str(best["speedup_vs_same_total_threads"])})
        singles = [r for r in pcp["results"] if r["layout"] == "1x1x1@1" and 2048 <= r["prompt_tokens"] <= 8192]
        if singles and "ceiling_fraction" in singles[0]:
            fractions = ", ".join(f"{r['prompt_tokens']}: {r['ceiling_fraction']}" for r in singles)
            rows.append({"target": "single-rank prefill, fraction of fp32 matmul ceiling (1 thread)",
                         "goal": ">= 0.80", "measured": fractions})
    compare = results.get("compare")
    if compare:
        rows += _compare_targets(compare)
    lines = ["## Targets", "", "Computed from the results below (targets from the benchmarks issue; ceilings "
             "in docs/platform.md). Nothing here is asserted by tests.", ""]
    return lines + (md_table(rows) if rows else _missing(""))


def _compare_targets(compare: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    by = {(r["system"], r["threads"], r["prompt_tokens"]): r for r in compare["prefill"]}
    ratios = []
    for (system, threads, length), row in sorted(by.items()):
        other = by.get(("transformers", threads, length))
        if system == "cpllm" and other and 2048 <= length:
            ratios.append(f"{threads}t/{length}: {row['tokens_per_s'] / other['tokens_per_s']:.2f}")
    if ratios:
        rows.append({"target": "cpllm / transformers prefill tokens/s, same threads", "goal": ">= 1.15",
                     "measured": ", ".join(ratios)})
    decode = {(r["system"], r["batch_size"], r["context_tokens"]): r for r in compare["decode"]}
    config = _model_config()
    threads = compare["decode"][0]["threads"] if compare["decode"] else None
    ceiling = compare.get("ceilings", {}).get(str(threads))
    if config is not None and ceiling:
        from cpllm.bench.ceiling import weight_bytes_per_decode_step

        bound = ceiling["matvec_gbps"] * 1e9 / weight_bytes_per_decode_step(config)
        for (system, batch, context), row in sorted(decode.items()):
            if system == "cpllm" and batch == 1:
                rows.append({"target": f"cpllm batch-1 decode / fp32 weight-traffic bound ({bound:.1f} tok/s), "
                                       f"context {context}", "goal": ">= 0.90",
                             "measured": f"{row['tokens_per_s'] / bound:.2f}"})
    for (system, batch, context), row in sorted(decode.items()):
        single = decode.get(("llama.cpp", 1, context))
        if system == "cpllm" and batch == 16 and single:
            rows.append({"target": f"cpllm aggregate decode, 16 requests / llama.cpp single stream, context {context}",
                         "goal": ">= 4", "measured": f"{row['tokens_per_s'] / single['tokens_per_s']:.2f}"})
    return rows


# ---- measurements -------------------------------------------------------------------------------------

def ceiling_section(results: Results, images: str, rel: str) -> list[str]:
    lines = ["## Machine ceilings", "",
             "`cpllm bench ceiling`: a 2048x2048 fp32 `torch.matmul` (compute ceiling) and a matrix-vector "
             "product over 256 MiB of fp32 weights (the memory traffic that bounds batch-1 decode).", ""]
    data = results.get("ceiling")
    return lines + (md_table(data["results"]) if data else _missing("ceiling"))


def prefill_pcp_section(results: Results, images: str, rel: str) -> list[str]:
    lines = ["## Prefill with context parallelism", "",
             "`cpllm bench prefill`: time to first token of one prompt (random token ids, prefix caching off), "
             "one engine per layout, `TPxPCPxDCP@threads_per_rank`. Efficiency = TTFT(1 rank, same threads per "
             "rank) / (ranks x TTFT); the last column compares with one rank using the same total threads. "
             "`ceiling_fraction` = achieved GFLOP/s over the matmul ceiling measured at the same total threads.", ""]
    data = results.get("prefill_pcp")
    if not data:
        return lines + _missing("prefill")
    lines += md_table(data["results"]) + ["", "Parallel efficiency:", ""] + md_table(data["efficiency"])
    if os.path.exists(os.path.join(images, "prefill_pcp.png")):
        lines += ["", f"![prefill with PCP]({rel}/prefill_pcp.png)"]
    return lines


def compare_section(results: Results, images: str, rel: str) -> list[str]:
    lines = ["## cpllm vs transformers vs llama.cpp", "",
             "`benchmarks/compare.py`: the same prompts through each system in one process, interleaved, with the "
             "same thread count. `cpllm` (`--quantization none`) and transformers run fp32 weights dequantized from "
             "the GGUF file; `cpllm (auto)` and llama.cpp run its Q4_1 blocks as stored. Every system computes "
             "prefill logits for the last position only (transformers with `logits_to_keep=1`, as its `generate` "
             "does).", ""]
    data = results.get("compare")
    if not data:
        return lines + _missing("compare")
    for note in data.get("notes", []):
        lines += [f"> {note}", ""]
    lines += ["### Prefill", ""] + md_table(data["prefill"])
    from cpllm.bench.plot import plot_decode, plot_prefill

    plot_prefill(data["prefill"], os.path.join(images, "compare_prefill.png"), title="Prefill, same threads")
    lines += ["", f"![prefill comparison]({rel}/compare_prefill.png)", "", "### Decode", "",
              "Output tokens/s over all requests of the batch, steady state (`decode_steps` steps after the "
              "prefill). transformers repeats one prefilled KV cache over the batch; cpllm shares the prompt "
              "blocks through its prefix cache; llama.cpp runs one stream.", ""]
    lines += md_table(data["decode"])
    if data["decode"]:
        plot_decode(data["decode"], os.path.join(images, "compare_decode.png"), title="Decode, same threads")
        lines += ["", f"![decode comparison]({rel}/compare_decode.png)"]
    return lines


def decode_section(results: Results, images: str, rel: str) -> list[str]:
    lines = ["## Decode per layout", "", "`cpllm bench decode --shared-prefix`: steady decode per layout.", ""]
    data = results.get("decode_cpllm")
    if not data:
        return lines + _missing("decode")
    lines += md_table(data["results"])
    if os.path.exists(os.path.join(images, "decode_cpllm.png")):
        lines += ["", f"![decode per layout]({rel}/decode_cpllm.png)"]
    return lines


def tensor_parallel_section(results: Results, images: str, rel: str) -> list[str]:
    lines = ["## Tensor parallelism", "",
             "`cpllm bench prefill` and `cpllm bench decode` on SmolLM2 with TP=1 (1 and 2 threads) and TP=3 "
             "(1 thread per rank). SmolLM2 has 9 query heads and 3 KV heads, so TP=2 is refused and TP=3 gives each "
             "rank one KV head. Three ranks on two cores are oversubscribed: these rows show the cost of the "
             "all-reduces and of sharing cores, not a speed-up this machine can give.", ""]
    for name, title in (("tp_prefill", "Prefill"), ("tp_decode", "Decode")):
        data = results.get(name)
        lines += [f"### {title}", ""] + (md_table(data["results"]) if data else _missing(name)) + [""]
    return lines


def memory_section(results: Results, images: str, rel: str) -> list[str]:
    lines = ["## KV memory per rank", "",
             "`cpllm bench memory`: the same KV budget on every rank; the CP group holds cp_size times as many "
             "tokens. `longest_prompt` is found by asking the engine's admission check (max_tokens = 1); it is "
             "also capped by the model's max_position_embeddings.", ""]
    data = results.get("memory")
    return lines + (md_table(data["results"]) if data else _missing("memory"))


def comm_section(results: Results, images: str, rel: str) -> list[str]:
    lines = ["## Communication per prefill layer", "",
             "`cpllm bench comm`: bytes of new K/V one rank receives per layer. Formula: "
             "`2 * (PCP - 1) * n * kv_heads_per_rank * head_dim * 4` with `n` the largest rank's token count "
             "under the head-tail partition (ranks pad to it), for the ring and for an all-gather over gloo; where "
             "the ranks share a host the all-gather gathers the prompt's K and V in position order in shared memory "
             "(`comm.all_gather_rows`), and rank 0 reads `2 * (T - t_0) * kv_heads_per_rank * head_dim * 4`, the "
             "other ranks' tokens only (`gathered_in_order`; rows measured before that path show the padded "
             "figure). Measured: the collectives of `cpllm.distributed.comm` wrapped in the driver process (rank 0) "
             "during one prefill.", ""]
    data = results.get("comm")
    if not data:
        return lines + _missing("comm")
    return lines + md_table(data["results"])


def serve_section(results: Results, images: str, rel: str) -> list[str]:
    lines = ["## Serving load", "", "`cpllm bench serve`: concurrent streamed `/v1/completions` requests.", ""]
    data = results.get("serve")
    if not data:
        return lines + _missing("serve")
    lines += md_table([data["summary"]])
    if os.path.exists(os.path.join(images, "serve.png")):
        lines += ["", f"![serving load]({rel}/serve.png)"]
    return lines


def bounds_section(results: Results, images: str, rel: str) -> list[str]:
    """What limits the targets that are missed (from profiles with torch.profiler; prose, no figures)."""
    return [
        "## What bounds the missed targets", "",
        "- **Batch-1 decode with fp32 weights (`none`)** streams every weight once per token. Its decode steps run "
        "one C call per layer (the fused decode layers: a matrix-vector loop as fast as MKL's, and the norms, "
        "rotary, K/V store, attention and activation of the eager path without the Python around them), so at "
        "context 128 a step is within a few percent of the weight-streaming bound. The bound counts weights only: "
        "at context 2,048 each step also reads the request's float32 K/V (94 MB over 30 layers, a sixth of the "
        "weights' 538 MB), which caps the ratio near 0.85 with perfect streaming; the attention kernel reads it at "
        "about the weights' rate (about 16 GB/s on one thread since it prefetches into L2, section 'Decode "
        "attention'; 8 GB/s before). `--quantization auto` runs the GGUF's "
        "Q4_1 blocks as stored and reads a sixth of the bytes (issue 10's section below).",
        "- **Decode under PCP=2 against one rank with both cores**: on this machine the two cores share one memory "
        "system (the matrix-vector rate is the same with one thread and two, `bench ceiling`), and a decode step "
        "streams its weights and, at context 2,048, its float32 K/V (94 MB over 30 layers, more than the int4 "
        "weights). Two ranks that each stream half of every layer (the decode team: architecture.md) gain about "
        "what one rank's second thread gains; the team's five shared-memory barriers per layer cost about 0.3 ms "
        "of waiting per batch-1 step. What PCP cannot divide is each step's serial Python around the layers "
        "(scheduling, the step's broadcast and metadata, sampling): about 2 ms at batch 1, as long as the fused "
        "layers themselves at context 128. So batch-1 and batch-16 decode land at one rank's rate, give or take "
        "this machine's run-to-run noise. The same holds for TP=2 x DCP=2 (the tensor-parallel team, measured on "
        "a one-KV-head model of SmolLM2's shape whose batch-1 step takes 5 ms): in a batch-1 probe its fused layers "
        "ran 15% faster than one rank's with two threads (3.65 against 4.27 ms per step), and the "
        "vocabulary-parallel embedding and LM head (a collective each) and the driver's step broadcast took about "
        "0.5 ms of undivided time per step back. TP=2 without DCP reads the one KV head's whole cache on both "
        "ranks, twice one rank's K/V traffic.",
        "- **16-request decode** at context 2,048 is bound by attention: 16 queries each read 2,048 positions of "
        "K/V per layer (2.3 GFLOP per step). Where the C decode kernel runs, requests that share a prefix read it "
        "once each, from cache, which runs faster than gathering the union of their slots once and computing it "
        "through the SDPA kernel with a mask (the shared-key form, kept where the kernel does not run).",
        "- **PCP=2 prefill efficiency** (issue 12 (d) below): the profile there splits what PCP=2's rank 0 "
        "spends beyond half the one-rank time by operator class. The largest software cost was the log-sum-exp "
        "merge of each attention piece into its run (several per layer per rank, each stacking copies of the "
        "outputs); pieces now merge in place, about ten times cheaper, and adjacent key runs of a ring block share "
        "one kernel call. Pad rows and attention imbalance are zero at these sizes (the head-tail split is exact). "
        "What remains is mostly the matmuls and attention running slower while both cores compute (the calibrated "
        "`busy_node_fraction` in (c): the cores share memory bandwidth and clocks) and a rank waiting at the ring "
        "for the other, which any other process on the machine makes worse.",
        "- **Prefill vs transformers at long prompts**: attention's share grows with the prompt, and cpllm's "
        "prefill attention kernel gains less over the CPU flash kernel transformers runs at 4K tokens (1.3x) "
        "than at 1K (1.6-1.7x, section 'Prefill attention'), while the gain from skipping the LM head (and the "
        "last layer's unsampled rows) over every prompt position shrinks.",
    ]


def moe_profile_lines(data: dict[str, Any] | None) -> list[str]:
    """benchmarks/profile_moe.py's table: seconds per category of one prefill, one column per system x length."""
    if not data:
        return []
    runs = data["profiles"]
    categories = list(dict.fromkeys(c for table in runs.values() for c in table))
    rows = [{"category": c, **{run: table.get(c, 0.0) for run, table in runs.items()}} for c in categories]
    load = data["machine"].get("load_average")
    return ["Where the time goes (`benchmarks/profile_moe.py`: torch.profiler, one profiled prefill per cell, "
            "seconds of operator self time charged to the module it ran in; `wall` is the whole call, "
            "`untracked` what no operator accounts for: Python between operators and, for cpllm, the engine's "
            f"scheduling). Load average at the start: {load}; under load every cell stretches alike.", ""
            ] + md_table(rows, ["category", *runs]) + [""]


def moe_section(results: Results, images: str, rel: str) -> list[str]:
    lines = ["## Mixture of experts", "",
             "`benchmarks/moe_bench.py`: a random-weight Qwen3-MoE-shaped model saved as a Hugging Face folder "
             "(one tensor per expert), float32, prompts of random token ids. Every measurement alternates the "
             "systems inside each repeat and keeps the best repeat; the ratios are the result, the absolute "
             "times depend on the load other users put on this 2-core machine.", ""]
    data = results.get("moe")
    if not data:
        return lines + _missing("moe")
    m, load = data["model"], data["machine"].get("load_average")
    lines += [f"Model: {m['layers']} layers, hidden {m['hidden']}, {m['experts']} experts of {m['expert_size']} "
              f"rows, top-{m['top_k']}, 16 query / 4 KV heads of 64. Load average when the run started "
              f"(1/5/15 min, {data['machine'].get('cores')} cores): {load}.", ""]
    grouped = data.get("grouped_vs_dense_loop")
    if grouped:
        lines += ["### Grouped experts vs the dense loop", "",
                  f"One layer's experts on {grouped['tokens']} tokens, {grouped['threads']} thread: the grouped "
                  f"forward (tokens sorted by expert, one matmul pair per active expert) takes "
                  f"{grouped['grouped_s']} s, running every expert on every token and masking takes "
                  f"{grouped['dense_loop_s']} s: **{grouped['speedup']}x**.", ""]
    prefill = data.get("prefill_vs_transformers")
    if prefill:
        lines += ["### Prefill, single rank, vs transformers", "",
                  "Same weights, same threads; transformers runs a plain forward with `logits_to_keep=1` (what "
                  "`generate` computes for the prompt), first with its default experts implementation, then with "
                  "its eager per-expert loop on the same loaded model, the systems in rotating order; cpllm's "
                  "time is its whole TTFT (engine included), its LM head runs on the last row only. Each row is "
                  "one workload: `prompt_tokens` tokens, `threads` threads. "
                  "`cpllm_speedup_best` / `_median` = that row's fastest / median time over cpllm's; "
                  "`cpllm_speedup_cpu` the same with each run's CPU time (`cpu_s`, the fastest run's), which other "
                  "users' load moves much less than the wall time (one thread: it is what an idle core takes). "
                  f"The fp32 matmul ceiling measured right after was {prefill['matmul_ceiling_gflops']} GFLOP/s "
                  "(the load of that moment included: the fastest repeats can exceed it). Both engines compute "
                  "the same float32 products; where cpllm gains (the profile below shows each part): its expert "
                  "and attention-projection weights are prepacked for oneDNN's AVX-512 GEMM (10-20% faster than "
                  "the MKL `mm` transformers calls on these shapes); its attention is its own C kernel, not "
                  "PyTorch's CPU flash kernel (1.3-1.7x, section 'Prefill attention'); its last layer runs past "
                  "attention on the sampled row only (1/16 of the work here; transformers' `logits_to_keep` "
                  "trims only the LM head); and its sorting, copies and elementwise passes are several times "
                  "smaller than those of transformers' default grouped_mm path. transformers' eager loop is the "
                  "same expert algorithm as cpllm's (gather an expert's tokens, two matmuls, scatter-add).",
                  ""] + md_table(prefill["rows"]) + [""] + moe_profile_lines(results.get("moe_profile"))
    pcp = data.get("pcp")
    if pcp:
        lines += [f"### PCP=2 vs PCP=1, {pcp['prompt_tokens']}-token prompt", "",
                  "Time to first token, expert-TP (PCP=2: each rank holds half of every expert's rows), allgather "
                  "strategy. PCP=2 over PCP=1 with one thread per rank: "
                  f"**{pcp['pcp2_vs_pcp1_same_threads_per_rank']}x**; over PCP=1 with the same two threads in one "
                  f"rank: **{pcp['pcp2_vs_pcp1_same_total_threads']}x**. What PCP=2 adds over one rank "
                  "splitting the same matmuls over two threads: per MoE layer an all-gather of the PCP group's "
                  "tokens and a reduce-scatter of the expert outputs (16 MB each at 4K tokens), the attention "
                  "pieces' merges, and a full last layer (the skip of unsampled rows runs on one PCP rank only). "
                  "On an idle machine two threads of one rank therefore come out ahead; under other users' load, "
                  "when a thread loses its core, the other thread of its rank waits for it at every operator, and "
                  "the ranks only at the collectives.", ""] + md_table(pcp["rows"])
    return lines


SECTIONS = [usage_section, machine_section, targets_section, bounds_section, ceiling_section, prefill_pcp_section,
            compare_section, decode_section, tensor_parallel_section, moe_section, memory_section, comm_section,
            serve_section, commands_section]
