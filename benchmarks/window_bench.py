"""Issue 31's benchmark: a random model of Gemma 3 1B's shape (benchmarks/window_model.py) against the same weights
with every layer global, and against transformers' own Gemma 3 forward.

    python benchmarks/window_bench.py --part prefill --lengths 2048,4096 --rounds 3 --threads 1 \
        --out benchmarks/results/window_prefill.json
    python benchmarks/window_bench.py --part pcp --pcp-tokens 16384 --rounds 2 \
        --out benchmarks/results/window_pcp.json
    python benchmarks/window_bench.py --part decode --context 32768 --rounds 4 --steps 16 --threads 1 \
        --out benchmarks/results/window_decode.json

Parts (each its own process and JSON; docs/benchmarks.md's section is benchmarks/report_window.py):
- `prefill`: one rank, --threads threads, cpllm (fp32 weights) and transformers (sdpa, logits_to_keep=1, as its
  generate prefills) on the same weights in one process, taking turns within every round (the side that goes first
  alternates); each system's fastest and median round.
- `pcp`: time to first token of one --pcp-tokens prompt on one rank with two threads against PCP=2 with one thread
  per rank (`cpllm bench prefill`'s loop: an engine per layout and round, layouts in turn).
- `decode`: the hybrid model and the all-global one each prefill one --context prompt on one rank (--threads), then
  take turns decoding --steps batch-1 steps per round. The KV each request holds after its prefill comes from the
  engine's own accounting: the blocks the scheduler's tables hold per KV group (cpllm/kv_groups.py) times the bytes
  of a block of that group's layers, which are the rank's pool bytes (KVCapacity) over its blocks.
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
sys.path.insert(0, HERE)

from window_model import SHAPES, build_folders  # noqa: E402

from cpllm.bench.common import BenchLayout, machine_info, parse_int_list, parse_layout, random_prompt  # noqa: E402
from cpllm.bench.engines import build_llm, model_config_of  # noqa: E402
from cpllm.bench.prefill import WARMUP_TOKENS, parallel_efficiency, run_prefill_bench, time_prefill  # noqa: E402
from cpllm.engine.sampling_params import SamplingParams  # noqa: E402


def _log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] load {os.getloadavg()[0]:.2f}  {message}", flush=True)


def time_transformers(model, prompt: list[int]) -> float:
    ids = torch.tensor([prompt])
    start = time.perf_counter()
    with torch.inference_mode():
        model(input_ids=ids, logits_to_keep=1).logits[0, -1].argmax()  # what generate's prefill computes
    return time.perf_counter() - start


def timed(run, *args) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) of one prefill. At one thread the CPU time is what the run would
    take on an idle core: on this shared machine it moves far less than the wall time."""
    cpu = time.process_time()
    wall = run(*args)
    return wall, time.process_time() - cpu


def prefill_part(folder: str, args) -> dict:
    """cpllm against transformers' forward, same weights and threads, alternating within each round."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    lengths = parse_int_list(args.lengths, "--lengths")
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()
    llm, _ = build_llm(folder, BenchLayout.of(threads_per_rank=args.threads), strategy=None,
                       threads_per_rank=args.threads, context_tokens=max(lengths) + 64,
                       batch_tokens=max(lengths) + 64, engine_options=dict(quantization="none"))
    runs = {"cpllm": lambda p: timed(time_prefill, llm, p), "transformers": lambda p: timed(time_transformers, hf, p)}
    vocab, rows = hf.config.vocab_size, []
    try:
        for run in runs.values():
            run(random_prompt(WARMUP_TOKENS, vocab, seed=-1))
        for n in lengths:
            times: dict[str, list[float]] = {name: [] for name in runs}
            cpu: dict[str, list[float]] = {name: [] for name in runs}
            for r in range(args.rounds):
                prompt = random_prompt(n, vocab, seed=1000 * n + r)  # the same prompt for both in a round
                for name in list(runs)[::1 if r % 2 == 0 else -1]:
                    wall, cpu_s = runs[name](prompt)
                    times[name].append(wall)
                    cpu[name].append(cpu_s)
                _log(f"prefill {n} round {r}: " + ", ".join(f"{k} {v[-1]:.2f} s (cpu {cpu[k][-1]:.2f} s)"
                                                            for k, v in times.items()))
            best = {k: min(v) for k, v in times.items()}
            median = {k: statistics.median(v) for k, v in times.items()}
            cpu_best = {k: min(v) for k, v in cpu.items()}
            for name, seconds in times.items():
                rows.append({"system": name, "threads": args.threads, "prompt_tokens": n,
                             "ttft_s": round(best[name], 3), "ttft_median_s": round(median[name], 3),
                             "cpu_s": round(cpu_best[name], 3), "tokens_per_s": round(n / best[name], 1),
                             "cpllm_speedup_best": round(best[name] / best["cpllm"], 3),
                             "cpllm_speedup_median": round(median[name] / median["cpllm"], 3),
                             "cpllm_speedup_cpu": round(cpu_best[name] / cpu_best["cpllm"], 3),
                             "all_s": [round(t, 3) for t in seconds], "all_cpu_s": [round(t, 3) for t in cpu[name]]})
    finally:
        llm.shutdown()
    return {"prefill": rows}


def pcp_part(folder: str, args) -> dict:
    """TTFT on one rank (two threads) against PCP=2 (one thread per rank), an engine per layout and round."""
    layouts = [parse_layout(text) for text in args.pcp_layouts.split(",")]
    strategies = args.pcp_strategies.split(",")
    results = run_prefill_bench(folder, lengths=[args.pcp_tokens], layouts=layouts, strategies=strategies,
                                repeats=args.rounds, engine_options=dict(quantization="none"),
                                progress=lambda text: _log(f"pcp {text}"))
    return {"pcp": [r.row() for r in results], "efficiency": parallel_efficiency(results)}


def request_kv(engine, request_id: str) -> dict:
    """Blocks and bytes the request holds now in each KV group, from the scheduler's tables and the pool bytes."""
    kv = engine.executor.rank_info.kv
    groups = engine.kv_groups
    group_blocks = kv.group_blocks or (kv.num_blocks,)
    layer_block_bytes = kv.bytes // sum(n * len(g.layers) for g, n in zip(groups, group_blocks))
    held = engine.scheduler.request_blocks(request_id)
    per_group = [{"group": g.describe(), "blocks": b, "bytes": b * len(g.layers) * layer_block_bytes}
                 for g, b in zip(groups, held)]
    return {"groups": per_group, "bytes": sum(g["bytes"] for g in per_group), "layer_block_bytes": layer_block_bytes,
            "pool_bytes": kv.bytes, "pool_group_blocks": list(group_blocks)}


class DecodeSide:
    """One engine holding one prefilled request of `context` tokens, stepping it on demand."""

    def __init__(self, name: str, folder: str, args):
        steps = args.steps * args.rounds + 8
        self.name, self.folder = name, folder
        self.llm, _ = build_llm(folder, BenchLayout.of(threads_per_rank=args.threads), strategy=None,
                                threads_per_rank=args.threads, context_tokens=args.context + steps + 16,
                                batch_tokens=args.chunk, engine_options=dict(quantization="none", max_num_seqs=1))
        self.engine = self.llm.engine
        vocab = model_config_of(folder).vocab_size
        params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
        torch.set_num_threads(args.prefill_threads)  # untimed set-up; big matmuls use both cores well
        start = time.perf_counter()
        self.engine.add_request(name, random_prompt(args.context, vocab, seed=args.context), params)
        while not any(o.outputs[0].token_ids for o in self.engine.step()):
            pass  # until the first token: the whole prompt is in the cache
        self.prefill_s = time.perf_counter() - start
        torch.set_num_threads(args.threads)
        self.kv = request_kv(self.engine, name)
        self.step_s: list[float] = []

    def decode(self, steps: int) -> float:
        start = time.perf_counter()
        for _ in range(steps):
            self.engine.step()
        seconds = time.perf_counter() - start
        self.step_s.append(seconds / steps)
        return seconds

    def close(self) -> dict:
        peak = list(self.engine.scheduler.peak_request_blocks)
        self.engine.abort_request(self.name)
        self.llm.shutdown()
        return {"peak_request_blocks": peak}


def decode_part(folders: dict[str, str], args) -> dict:
    sides = []
    try:
        for name, folder in folders.items():
            sides.append(DecodeSide(name, folder, args))
            _log(f"decode {name}: prefilled {args.context} tokens in {sides[-1].prefill_s:.1f} s, "
                 f"KV {sides[-1].kv['bytes'] / 2**20:.1f} MiB")
        for side in sides:
            side.decode(4)  # warm-up
        for r in range(args.rounds):
            for side in sides[::1 if r % 2 == 0 else -1]:
                seconds = side.decode(args.steps)
                _log(f"decode {side.name} round {r}: {args.steps / seconds:.2f} tok/s")
        rows = []
        for side in sides:
            rates = [1 / s for s in side.step_s[1:]]
            rows.append({"model": side.name, "threads": args.threads, "context_tokens": args.context,
                         "tokens_per_s": round(statistics.median(rates), 2),
                         "tokens_per_s_rounds": [round(x, 2) for x in rates],
                         "prefill_s": round(side.prefill_s, 1), "kv": side.kv})
    finally:
        peaks = [side.close() for side in sides]
    for row, peak in zip(rows, peaks):
        row["kv"].update(peak)
    return {"decode": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("prefill", "pcp", "decode"), required=True)
    parser.add_argument("--shape", choices=tuple(SHAPES), default="gemma3-1b", help="tiny: the smoke test's")
    parser.add_argument("--layers", type=int, default=6, help="decoder layers, 6 or more (Gemma 3 1B: 26, full layers 5, 11, 17, 23)")
    parser.add_argument("--vocab", type=int, default=32768, help="vocabulary (Gemma 3 1B: 262144)")
    parser.add_argument("--max-positions", type=int, default=33280)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the one-rank parts")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--lengths", default="2048,4096", help="prefill: prompt lengths")
    parser.add_argument("--pcp-tokens", type=int, default=16384)
    parser.add_argument("--pcp-layouts", default="1x1x1@2,1x2x1@1")
    parser.add_argument("--pcp-strategies", default="auto")
    parser.add_argument("--context", type=int, default=32768, help="decode: context tokens")
    parser.add_argument("--chunk", type=int, default=8192, help="decode: prefill chunk (max_num_batched_tokens)")
    parser.add_argument("--steps", type=int, default=16, help="decode: steps per round")
    parser.add_argument("--prefill-threads", type=int, default=2, help="decode: torch threads of the set-up prefill")
    parser.add_argument("--cache", default="/tmp/cpllm-window-bench")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    hybrid, full = build_folders(args.cache, args.layers, args.vocab, args.max_positions, args.shape)
    machine = machine_info()
    machine["load_average_start"] = machine.pop("load_average")
    if args.part == "prefill":
        data = prefill_part(hybrid, args)
    elif args.part == "pcp":
        data = pcp_part(hybrid, args)
    else:
        data = decode_part({"Gemma 3 pattern (5 sliding : 1 full)": hybrid, "every layer global": full}, args)
    machine["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    fields = SHAPES[args.shape]
    model = {"shape": args.shape, "layers": args.layers, "vocab": args.vocab, "hidden": fields["hidden_size"],
             "heads": fields["num_attention_heads"], "kv_heads": fields["num_key_value_heads"],
             "head_dim": fields["head_dim"], "intermediate": fields["intermediate_size"],
             "window": fields["sliding_window"], "full_layers": [i for i in range(args.layers) if (i + 1) % 6 == 0]}
    with open(args.out, "w") as f:
        json.dump({"argv": ["python", "benchmarks/window_bench.py", *sys.argv[1:]], "part": args.part,
                   "model": model, "rounds": args.rounds, "machine": machine, **data}, f, indent=1)
    _log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
