"""MoE prefill: cpllm vs transformers' own MoE forward on the same random weights, grouped vs dense-loop experts,
and PCP=2 vs PCP=1 time to first token. Writes benchmarks/results/moe.json (docs/benchmarks.md's MoE section).

The model is Qwen3-MoE-shaped with random weights (default: 16 layers, hidden 1024, 16 query / 4 KV heads of
64, 64 experts of 256 rows, top-8, every layer sparse), saved once as a Hugging Face folder (one tensor per
expert) with the tests' tiny byte-level tokenizer (prompts are random token ids; the vocabulary only sizes the
embedding and LM head, which the last-row-only prefill barely touches).

Measurements alternate between the systems inside each repeat and keep the best repeat (on a shared machine
other load only ever adds time); the report gives ratios, by wall time and by CPU time (one thread: the CPU time
is what an idle core would take, and other users' load moves it much less).

    python benchmarks/moe_bench.py --threads 1 --prefill-tokens 1024,4096 --pcp-tokens 4096 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))  # the tiny tokenizer

from cpllm.bench.ceiling import prefill_flops  # noqa: E402
from cpllm.bench.common import BenchLayout, machine_info, random_prompt  # noqa: E402
from cpllm.bench.engines import build_llm  # noqa: E402
from cpllm.bench.prefill import time_prefill  # noqa: E402
from cpllm.model.loaders.loader import open_weights  # noqa: E402
from cpllm.model.moe.experts import LocalExperts  # noqa: E402
from cpllm.model.moe.placement import expert_slice  # noqa: E402
from cpllm.distributed.parallel_context import ParallelContext  # noqa: E402
from cpllm.model.moe.router import Router  # noqa: E402


def model_config(args):
    from tiny_models import tiny_vocab
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=len(tiny_vocab().tokens), hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64, num_key_value_heads=4, head_dim=64, intermediate_size=4 * args.hidden,
        moe_intermediate_size=args.expert_size, num_experts=args.experts, num_experts_per_tok=args.top_k,
        norm_topk_prob=True, max_position_embeddings=args.pcp_tokens + 512, rope_theta=1e6,
        tie_word_embeddings=False,
    )


def build_folder(args) -> str:
    """Save the random model once (reused while its config is unchanged)."""
    from tiny_models import save_random_hf_folder

    folder = os.path.join(args.cache, f"qwen3moe-l{args.layers}-h{args.hidden}-e{args.experts}-k{args.top_k}-"
                                      f"i{args.expert_size}")
    return save_random_hf_folder(model_config(args), folder)


def timed(run, prompt: list[int]) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) of one prefill. At one thread the CPU time is what the run would
    take on an idle core: on this shared machine it varies far less than the wall time."""
    cpu = time.process_time()
    wall = run(prompt)
    return wall, time.process_time() - cpu


def time_transformers(model, prompt: list[int]) -> float:
    ids = torch.tensor([prompt])
    start = time.perf_counter()
    with torch.inference_mode():
        model(ids, logits_to_keep=1)  # what generate's prefill computes
    return time.perf_counter() - start


def prefill_vs_transformers(folder: str, args) -> dict:
    """Single rank, same threads: cpllm's TTFT and transformers' prefill forward, alternating, at each prompt
    length; transformers runs its default experts implementation and (up to --eager-max-tokens) its eager
    per-expert loop, switched on the same loaded model."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    lengths = [int(n) for n in str(args.prefill_tokens).split(",")]
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    llm, _ = build_llm(folder, BenchLayout.of(tp=1, pcp=1, dcp=1, threads_per_rank=args.threads), strategy=None,
                       threads_per_rank=args.threads, context_tokens=max(lengths) + 64,
                       batch_tokens=max(lengths) + 64, engine_options=dict(quantization="none"))
    vocab, experts_impl = hf.config.vocab_size, hf.config._experts_implementation  # transformers' default choice
    default, eager = f"transformers ({experts_impl})", "transformers (eager)"

    def with_experts(impl: str):
        def run(prompt: list[int]) -> float:
            hf.set_experts_implementation(impl)
            return time_transformers(hf, prompt)
        return run

    runs = {"cpllm": lambda p: time_prefill(llm, p), default: with_experts(experts_impl), eager: with_experts("eager")}
    rows = []
    try:
        time_prefill(llm, random_prompt(64, vocab, seed=-1))
        time_transformers(hf, random_prompt(64, vocab, seed=-1))
        for n in lengths:
            names = [k for k in runs if k != eager or n <= args.eager_max_tokens]
            rows += measure_length(runs, names, n, vocab, args)
    finally:
        llm.shutdown()
    return {"rows": rows, "matmul_ceiling_gflops": matmul_ceiling(args)}


def measure_length(runs: dict, names: list[str], n: int, vocab: int, args) -> list[dict]:
    """Rows for one prompt length: the systems in rotating order per repeat (no system always runs first)."""
    wall: dict[str, list[float]] = {k: [] for k in names}
    cpu: dict[str, list[float]] = {k: [] for k in names}
    for repeat in range(args.repeats):
        prompt = random_prompt(n, vocab, seed=repeat)
        for name in names[repeat % len(names):] + names[: repeat % len(names)]:
            w, c = timed(runs[name], prompt)
            wall[name].append(w)
            cpu[name].append(c)
        print(f"{n} tokens, repeat {repeat}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in wall.items()), flush=True)
    best = {k: min(v) for k, v in wall.items()}
    median = {k: statistics.median(v) for k, v in wall.items()}
    cpu_best = {k: min(v) for k, v in cpu.items()}
    flops = prefill_flops(open_weights(args.folder).config, n).total
    return [{"system": k, "threads": args.threads, "prompt_tokens": n, "ttft_s": round(t, 3),
             "ttft_median_s": round(median[k], 3), "cpu_s": round(cpu_best[k], 3),
             "tokens_per_s": round(n / t, 1), "gflops": round(flops / t / 1e9, 1),
             "cpllm_speedup_best": round(t / best["cpllm"], 2),
             "cpllm_speedup_median": round(median[k] / median["cpllm"], 2),
             "cpllm_speedup_cpu": round(cpu_best[k] / cpu_best["cpllm"], 2),
             "all_s": [round(x, 3) for x in wall[k]]}
            for k, t in best.items()]


def matmul_ceiling(args) -> float:
    """This machine's fp32 matmul rate at the bench's threads, measured now (the load of the moment included)."""
    from cpllm.bench.ceiling import matmul_gflops

    return round(matmul_gflops(threads=args.threads), 1)


def dense_loop(experts: LocalExperts, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The baseline: every expert on every token, weighted by its routing weight (0 where not chosen)."""
    gate_up, down = experts.plain_weights()
    dense = torch.zeros(x.shape[0], gate_up.shape[0], dtype=x.dtype).scatter_(1, ids, weights)
    out = torch.zeros_like(x)
    rows = experts.held.rows
    for e in range(gate_up.shape[0]):
        gate, up = (x @ gate_up[e]).split(rows, dim=-1)
        out += dense[:, e : e + 1] * ((torch.nn.functional.silu(gate) * up) @ down[e])
    return out


def grouped_vs_dense(folder: str, args) -> dict:
    """One layer's experts on the first prefill length's hidden states: the grouped forward vs the dense loop."""
    torch.set_num_threads(args.threads)
    source = open_weights(folder)
    moe, hidden = source.config.moe, source.config.hidden_size
    prefix = "model.layers.0.mlp"
    experts = LocalExperts(prefix, moe.expert_weight_names, hidden,
                           expert_slice(moe.num_experts, moe.intermediate_size, ParallelContext()),
                           torch.float32)
    experts.load(source)
    router = Router(f"{prefix}.gate.weight", hidden, moe.num_experts, moe.top_k, moe.norm_topk_prob)
    router.load(source)
    tokens = int(str(args.prefill_tokens).split(",")[0])
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        weights, ids = router(x)
        assert torch.allclose(experts(x, weights, ids), dense_loop(experts, x, weights, ids), atol=1e-5)
        times: dict[str, list[float]] = {"grouped": [], "dense_loop": []}
        for _ in range(args.repeats + 1):
            for name, fn in (("grouped", experts), ("dense_loop", lambda *a: dense_loop(experts, *a))):
                start = time.perf_counter()
                fn(x, weights, ids)
                times[name].append(time.perf_counter() - start)
    best = {k: min(v) for k, v in times.items()}
    return {"tokens": tokens, "threads": args.threads,
            "grouped_s": round(best["grouped"], 4), "dense_loop_s": round(best["dense_loop"], 4),
            "speedup": round(best["dense_loop"] / best["grouped"], 2)}


def pcp_ttft(folder: str, args) -> dict:
    """TTFT of one `pcp_tokens` prompt: PCP=1 (1 thread, and 2 threads) vs PCP=2 (1 thread per rank)."""
    layouts = {"1x1x1@1": BenchLayout.of(tp=1, pcp=1, dcp=1, threads_per_rank=1),
               "1x1x1@2": BenchLayout.of(tp=1, pcp=1, dcp=1, threads_per_rank=2),
               "1x2x1@1": BenchLayout.of(tp=1, pcp=2, dcp=1, threads_per_rank=1)}
    vocab = open_weights(folder).config.vocab_size
    times: dict[str, list[float]] = {name: [] for name in layouts}
    for repeat in range(args.pcp_repeats):
        for name, layout in layouts.items():
            llm, _ = build_llm(folder, layout, strategy="allgather", threads_per_rank=layout.threads_per_rank,
                               context_tokens=args.pcp_tokens + 64, batch_tokens=args.pcp_tokens + 64,
                               engine_options=dict(quantization="none"))
            try:
                time_prefill(llm, random_prompt(64, vocab, seed=-1))
                times[name].append(time_prefill(llm, random_prompt(args.pcp_tokens, vocab, seed=repeat)))
            finally:
                llm.shutdown()
            print(f"pcp repeat {repeat} {name}: {times[name][-1]:.2f} s", flush=True)
    best = {k: min(v) for k, v in times.items()}
    return {"prompt_tokens": args.pcp_tokens,
            "rows": [{"layout": k, "ttft_s": round(t, 2), "tokens_per_s": round(args.pcp_tokens / t, 1),
                      "all_s": [round(x, 2) for x in times[k]]} for k, t in best.items()],
            "pcp2_vs_pcp1_same_threads_per_rank": round(best["1x1x1@1"] / best["1x2x1@1"], 2),
            "pcp2_vs_pcp1_same_total_threads": round(best["1x1x1@2"] / best["1x2x1@1"], 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--expert-size", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prefill-tokens", default="1024,4096", help="prompt lengths vs transformers, comma-separated")
    parser.add_argument("--eager-max-tokens", type=int, default=1024,
                        help="longest prompt transformers' eager experts loop also runs (it is the slow baseline)")
    parser.add_argument("--pcp-tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--pcp-repeats", type=int, default=1)
    parser.add_argument("--skip", nargs="*", default=[], choices=["transformers", "grouped", "pcp"])
    parser.add_argument("--cache", default="/tmp/cpllm-moe-bench")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "moe.json"))
    args = parser.parse_args()
    folder = args.folder = build_folder(args)
    result = {"machine": machine_info(), "model": {k: getattr(args, k) for k in
                                                   ("layers", "hidden", "experts", "top_k", "expert_size")}}
    if "grouped" not in args.skip:
        result["grouped_vs_dense_loop"] = grouped_vs_dense(folder, args)
        print(result["grouped_vs_dense_loop"], flush=True)
    if "transformers" not in args.skip:
        result["prefill_vs_transformers"] = prefill_vs_transformers(folder, args)
        print(result["prefill_vs_transformers"], flush=True)
    if "pcp" not in args.skip:
        result["pcp"] = pcp_ttft(folder, args)
        print(result["pcp"], flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
