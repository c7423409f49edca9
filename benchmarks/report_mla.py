"""The section of docs/benchmarks.md on issue 25's benchmark: a random model of DeepSeek-V2-Lite's per-layer shape,
from benchmarks/mla_bench.py (mla_dcp.json, mla_layer.json, mla_prefill.json)."""

from __future__ import annotations

from typing import Any

from report_sections import Results, _missing, md_table

TITLE = "## Multi-head latent attention: DeepSeek-V2-Lite's shape (issue 25)"


def _model_line(data: dict[str, Any]) -> str:
    m = data["model"]
    return (f"`benchmarks/mla_bench.py` (model: `benchmarks/mla_model.py`): transformers' DeepseekV2Config at "
            f"DeepSeek-V2-Lite's per-layer shape with random fp32 weights (hidden {m['hidden_size']}, "
            f"{m['num_attention_heads']} heads, queries direct, kv_lora_rank {m['kv_lora_rank']}, rope "
            f"{m['qk_rope_head_dim']}, nope {m['qk_nope_head_dim']}, v {m['v_head_dim']}: a latent row of "
            f"{m['kv_lora_rank'] + m['qk_rope_head_dim']} values per token and layer; {m['n_routed_experts']} routed "
            f"experts of {m['moe_intermediate_size']} rows, {m['num_experts_per_tok']} active, "
            f"{m['n_shared_experts']} shared; first_k_dense_replace {m['first_k_dense_replace']}, a dense MLP of "
            f"{m['intermediate_size']} rows; V2-Lite's YaRN rotary), cut to **{m['layers']} layers** (the first "
            f"dense, the rest sparse; 27 released: one sparse layer is 2.2 GB of fp32 weights, and transformers' "
            f"copy sits beside cpllm's in the prefill comparison) and a **vocabulary of {m['vocab']}** (102400 "
            "released), so that 16K-token prompts fit the two shared cores in the time there was. The ratios between "
            "the compared sides are what these figures are for; the absolute times are this shared machine's "
            "(several other jobs ran on it: see each table's load average). `--quantization none`, float32 KV, "
            "block size 16.")


def _load(data: dict[str, Any]) -> str:
    machine = data["machine"]
    return (f"Load average (1, 5, 15 min) at the start {machine.get('load_average_start')}, at the end "
            f"{machine.get('load_average_end')}")


def _arg(data: dict[str, Any], flag: str, default: str = "?") -> str:
    argv = data["argv"]
    return argv[argv.index(flag) + 1] if flag in argv else default


def kv_and_dcp(data: dict[str, Any]) -> list[str]:
    rows = data["dcp"]
    base = rows[0]
    kv_rows = [{"layout": r["layout"], "--kv-cache-memory-bytes": r["kv"]["kv_cache_memory_bytes"],
                "pool bytes per rank": r["kv"]["pool_bytes_per_rank"],
                "token slots per rank": r["kv"]["slots_per_rank"],
                "bytes per token stored on a rank": r["kv"]["bytes_per_token_stored"],
                "ranks a request is divided over": r["kv"]["kv_shard_ranks"],
                "bytes per token of a request per rank": r["kv"]["bytes_per_token_per_rank"],
                "tokens held (replica)": r["kv"]["tokens_held"],
                "vs TP=2": f"{r['kv']['tokens_held'] / base['kv']['tokens_held']:.2f}"} for r in rows]
    decode_rows = [{"layout": r["layout"], "context_tokens": r["context_tokens"], "tokens_per_s": r["tokens_per_s"],
                    f"vs {base['layout']} (median of rounds)": f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}",
                    "per-round ratios": ", ".join(map(str, r["ratio_rounds"])),
                    "rounds (tokens/s)": ", ".join(map(str, r["tokens_per_s_rounds"])),
                    "set-up prefill (s, one run, not compared)": r["prefill_s"]} for r in rows]
    context, steps = base["context_tokens"], base["steps"]
    return [
        "### Latent KV per rank: TP=2 against TP=2 x DCP=2", "",
        "Each layout's engine starts with the same `--kv-cache-memory-bytes`; the figures are the engine's own: the "
        "rank's allocated pool bytes and token slots (`KVCapacity`, the executor's `rank_info`) and the tokens the "
        "replica holds (`LLMEngine.kv_capacity_tokens`), which the start-up log's latent-cache line prints. Without "
        "DCP both TP ranks hold every latent row; with DCP=2 each holds every other one "
        f"(interleave {_arg(data, '--interleave', '1')}), so a token of a request costs a rank half the bytes and "
        "the replica holds twice the tokens.", "", *md_table(kv_rows), "",
        f"### Decode at {context} tokens: TP=2 x DCP=2 against TP=2", "",
        f"One driver process per layout (one thread per rank, two ranks each), each holding one prefilled "
        f"{context}-token request (prefilled in chunks of {_arg(data, '--chunk', '4096')} tokens, one layout at a "
        f"time); then they take turns, {steps} batch-1 decode steps each per round, the one going first "
        "alternating (a warm-up round first, not counted). DCP=2 gathers the 16 heads' absorbed queries over the "
        "DCP group, attends half the latents on each rank and returns float32 partials and log-sum-exps by "
        "all-to-all (context_parallel.md, \"MLA\"). Per rank the two layouts do the same attention arithmetic "
        "(TP=2: its 8 heads over every latent; DCP=2: all 16 heads over half of them); DCP=2 reads half the latent "
        "bytes and adds two small collectives per layer, and the weights each rank reads per step are the same TP "
        "halves. What DCP buys is the tokens held, above; decode speed is expected to stay about even.", "",
        *md_table(decode_rows), "", _load(data) + "."]


def layer(data: dict[str, Any]) -> list[str]:
    rows = data["layer"]
    table = []
    for r in rows:
        table.append({"form": r["form"], "context_tokens": r["context_tokens"], "threads": r["threads"],
                      "ms per token (fastest)": round(1e3 * r["best_s"], 2),
                      "ms (median)": round(1e3 * r["median_s"], 2), "CPU ms (fastest)": round(1e3 * r["cpu_s"], 2),
                      "tokens_per_s": r["tokens_per_s"],
                      "absorbed speed-up (fastest)": f"{r['speedup_best']:.1f}",
                      "absorbed speed-up (CPU time)": f"{r['speedup_cpu']:.1f}",
                      "max abs difference": f"{r['max_abs_diff']:.1e} (of {r['max_abs_out']:.2f})"})
    return ["### Batch-1 decode of one layer: absorbed against expanded", "",
            "The engine always decodes in the absorbed form (there is no switch), so the two forms are compared on "
            "one MLA layer (layer 0's weights) with a latent pool of random rows holding the context: the absorbed "
            "form is `MLAAttention.forward` through the CP layer, as a decode step runs it (W_UK folded into the "
            "queries, multi-query attention over the 576-wide latents in place, W_UV after), the expanded form "
            "`MLAAttention.forward_expanded` (every cached latent expanded to the 16 heads' keys and values by "
            "kv_b_proj, as transformers computes it). The layer's projections are included; the MLP and LM head "
            "are not. They take turns in every round; the outputs of the last round are compared (float32 "
            "rounding). The CPU time is the process's, of its fastest round: at one thread, what an idle core "
            "would take.", "", *md_table(table), "", _load(data) + "."]


def prefill(data: dict[str, Any]) -> list[str]:
    rows = data["prefill"]
    table = [{"system": r["system"], "threads": r["threads"], "prompt_tokens": r["prompt_tokens"],
              "ttft_s (fastest)": r["best_s"], "ttft_s (median)": r["median_s"], "cpu_s": r["cpu_s"],
              "tokens_per_s": r["tokens_per_s"], "cpllm speed-up (fastest)": f"{r['speedup_best']:.2f}",
              "cpllm speed-up (median)": f"{r['speedup_median']:.2f}",
              "cpllm speed-up (CPU time)": f"{r['speedup_cpu']:.2f}",
              "rounds (s)": ", ".join(map(str, r["all_s"]))} for r in rows]
    return ["### Prefill on one rank against transformers, same weights and threads", "",
            "One process, one rank: cpllm and transformers' own DeepseekV2ForCausalLM forward (sdpa attention, its "
            "default experts implementation, `logits_to_keep=1` as its `generate` prefills) load the same "
            "safetensors and run with the same torch threads, taking turns on the same prompt in every round (the "
            "one going first alternates). cpllm's prefill attends the new tokens in the expanded form and routes "
            "in float32 as transformers does. The speed-ups are transformers' time over cpllm's: of the fastest "
            "rounds, of the medians, and of the process's CPU time (fastest round; at one thread that is what an "
            "idle core would take). Target: cpllm / transformers >= 1.5.", "", *md_table(table), "",
            _load(data) + "."]


def mla_section(results: Results, images: str, rel: str) -> list[str]:
    lines = [TITLE, ""]
    names = ("mla_dcp", "mla_layer", "mla_prefill")
    present = [results[name] for name in names if name in results]
    if not present:
        return lines + _missing("mla")
    lines += [_model_line(present[0]), ""]
    for name, render in zip(names, (kv_and_dcp, layer, prefill)):
        lines += (render(results[name]) if name in results else [f"### {name}", "", *_missing("mla")]) + [""]
    return lines[:-1]


MLA_SECTIONS = [mla_section]
