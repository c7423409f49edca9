"""The section of docs/benchmarks.md on issue 31's benchmark: a random model of Gemma 3 1B's shape against the same
weights with every layer global, PCP=2 and transformers, from benchmarks/window_bench.py (window_prefill.json,
window_pcp.json, window_decode.json)."""

from __future__ import annotations

from typing import Any

from report_sections import Results, _missing, md_table

TITLE = "## Sliding windows: Gemma 3 1B's shape (issue 31)"


def _model_line(data: dict[str, Any]) -> str:
    m = data["model"]
    full = ", ".join(map(str, m["full_layers"]))
    return (f"`benchmarks/window_bench.py` (model: `benchmarks/window_model.py`): transformers' Gemma3TextConfig at "
            f"Gemma 3 1B's shape with random fp32 weights (hidden {m['hidden']}, {m['heads']} query heads and "
            f"{m['kv_heads']} KV head of {m['head_dim']}, GeGLU MLP of {m['intermediate']}, window {m['window']}, "
            f"local rotary base 10000, global 1e6), **{m['layers']} layers** (full: layer {full}"
            f"{_depth_note(m['layers'])}) and a **vocabulary of {m['vocab']}** (262144 released: the prompts' "
            "logits are the last position's only, so the vocabulary moves no figure below by much). The ratios between the compared sides are what these figures are "
            "for; the absolute times are this shared machine's. \"Every layer global\" is the same weights with "
            "`layer_types` all `full_attention`. `--quantization none`, float32 KV, block size 16.")


def _depth_note(layers: int) -> str:
    if layers == 26:
        return "; the released depth: four periods of five sliding and one full layer, then two more sliding"
    return "; cut from the released 26 so that the long prompts fit the two shared cores"


def _load(data: dict[str, Any]) -> str:
    machine = data["machine"]
    start, end = machine.get("load_average_start"), machine.get("load_average_end")
    return f"Load average (1, 5, 15 min) at the start {start}, at the end {end}"


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def kv_and_decode(data: dict[str, Any]) -> list[str]:
    rows = data["decode"]
    context = rows[0]["context_tokens"]
    full = next(r for r in rows if r["model"] == "every layer global")
    kv_rows, decode_rows = [], []
    for r in rows:
        kv = r["kv"]
        kv_rows.append({"model": r["model"], "context_tokens": r["context_tokens"],
                        "blocks held per KV group": "; ".join(f"{g['group']}: {g['blocks']}" for g in kv["groups"]),
                        "KV MiB per request": _mib(kv["bytes"]),
                        "vs every layer global": f"{kv['bytes'] / full['kv']['bytes']:.3f}",
                        "peak blocks during the prefill": ", ".join(map(str, kv["peak_request_blocks"]))})
        decode_rows.append({"model": r["model"], "threads": r["threads"], "context_tokens": r["context_tokens"],
                            "tokens_per_s": r["tokens_per_s"],
                            "vs every layer global": f"{r['tokens_per_s'] / full['tokens_per_s']:.2f}",
                            "rounds (tokens/s)": ", ".join(map(str, r["tokens_per_s_rounds"]))})
    steps = data["argv"][data["argv"].index("--steps") + 1] if "--steps" in data["argv"] else "?"
    return [
        f"### KV bytes per request at {context} tokens", "",
        f"Each model prefills one {context}-token prompt on one rank (in chunks of "
        f"{data['argv'][data['argv'].index('--chunk') + 1] if '--chunk' in data['argv'] else 8192} tokens); then the "
        "blocks the request holds in each KV group are read from the scheduler's block tables "
        "(`Scheduler.request_blocks`, cpllm/kv_groups.py's groups) and multiplied by the bytes of one block of "
        "the group's layers (the rank's pool bytes from `KVCapacity` over its blocks): the engine's own accounting, "
        "not a formula. A sliding group holds at most the window and one block (512 / 16 + 1 = 33 "
        "blocks) whatever the context; the peak column is the most a request held during a step (the prefill "
        "chunk's blocks included).",
        "", *md_table(kv_rows), "",
        f"### Batch-1 decode at {context} tokens of context", "",
        f"The two engines above, each holding its prefilled request, take turns decoding {steps} steps per round "
        "(the one going first alternates); a round's figure is its steps over its wall time, the table the median "
        "over the rounds (after 4 untimed warm-up steps). Gemma decodes through the eager layers on both sides "
        "(the fused C layers compute Llama layers); a sliding layer's decode step reads only its window, a global one "
        "the whole context.", "", *md_table(decode_rows), "", _load(data) + ".",
    ]


def pcp(data: dict[str, Any]) -> list[str]:
    rows = data["pcp"]
    one = next(r for r in rows if r["layout"].startswith("1x1x1"))
    table = [{"layout": r["layout"], "strategy": r["strategy"], "threads": r["threads"],
              "prompt_tokens": r["prompt_tokens"], "ttft_s": r["ttft_s"], "ttft_median_s": r["ttft_median_s"],
              "rounds (s)": ", ".join(map(str, r["ttft_all_s"])),
              "speed-up over one rank": f"{one['ttft_s'] / r['ttft_s']:.2f}"} for r in rows]
    n = one["prompt_tokens"]
    return [f"### Time to first token at {n} tokens: one rank against PCP=2", "",
            f"`cpllm bench prefill`'s loop on the hybrid model: one engine per layout and round, the layouts in "
            f"turn, each warmed up and then given a fresh {n}-token prompt (prefix caching off). One rank runs two "
            "threads, PCP=2 one thread per rank, so both use both cores; the speed-up is of the fastest rounds. On "
            "two shared cores PCP=2 does the same work as the one rank on the same cores, so the ratio is what "
            "splitting the prompt costs here (its exchange of K/V and merges); PCP pays where each rank has cores or "
            "a device of its own.",
            "", *md_table(table), "", _load(data) + "."]


def prefill(data: dict[str, Any]) -> list[str]:
    rows = data["prefill"]
    table = [{"system": r["system"], "threads": r["threads"], "prompt_tokens": r["prompt_tokens"],
              "ttft_s": r["ttft_s"], "ttft_median_s": r["ttft_median_s"], "tokens_per_s": r["tokens_per_s"],
              "cpllm speed-up (fastest)": f"{r['cpllm_speedup_best']:.2f}",
              "cpllm speed-up (median)": f"{r['cpllm_speedup_median']:.2f}",
              "cpu_s": r.get("cpu_s", "-"),
              "cpllm speed-up (CPU time)": f"{r['cpllm_speedup_cpu']:.2f}" if "cpllm_speedup_cpu" in r else "-",
              "rounds (s)": ", ".join(map(str, r["all_s"]))} for r in rows]
    return ["### Prefill against transformers, same weights and threads", "",
            "One process, one rank: cpllm and transformers' own Gemma3ForCausalLM forward (sdpa attention, "
            "`logits_to_keep=1` as its `generate` prefills) load the same safetensors and run with the same torch "
            "threads, taking turns on the same prompt in every round (the one going first alternates). "
            "transformers attends each sliding layer over the whole prompt with a band mask; cpllm's window pieces "
            "skip the keys the window hides (layers/window/pieces.py). The speed-ups are transformers' time over "
            "cpllm's: of the fastest rounds, of the medians, and of the CPU time of the process (the fastest round; "
            "at one thread that is what an idle core would take, and the other helpers' load moves it much less "
            "than the wall time). Target: cpllm / transformers >= 1.2.",
            "", *md_table(table), "", _load(data) + "."]


def window_section(results: Results, images: str, rel: str) -> list[str]:
    lines = [TITLE, ""]
    names = ("window_decode", "window_pcp", "window_prefill")
    present = [results[name] for name in names if name in results]
    if not present:
        return lines + _missing("window")
    lines += [_model_line(present[0]), ""]
    for name, render in zip(names, (kv_and_decode, pcp, prefill)):
        lines += (render(results[name]) if name in results else
                  [f"### {name}", "", *_missing("window")]) + [""]
    return lines[:-1]


WINDOW_SECTIONS = [window_section]
