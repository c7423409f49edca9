"""Issue 25's benchmark: a random model of DeepSeek-V2-Lite's per-layer shape (benchmarks/mla_model.py).

    python benchmarks/mla_bench.py --part layer --contexts 2048,16384 --rounds 3 --threads 1 \
        --out benchmarks/results/mla_layer.json
    python benchmarks/mla_bench.py --part prefill --lengths 2048 --rounds 3 --threads 1 \
        --out benchmarks/results/mla_prefill.json
    python benchmarks/mla_bench.py --part dcp --context 16384 --rounds 3 --steps 8 \
        --out benchmarks/results/mla_dcp.json

Parts (each its own process and JSON; docs/benchmarks.md's section is benchmarks/report_mla.py):
- `layer`: batch-1 decode of one MLA layer (layer 0's weights) at each context, the absorbed form (what the
  engine's decode runs: MLAAttention.forward through the CP layer, multi-query attention over the latent pool)
  against the expanded form (MLAAttention.forward_expanded: every head's keys and values rebuilt from the cached
  latents, as transformers computes them). The engine has no switch to decode expanded, so this is measured at the
  layer level; the two take turns in every round, and their outputs are compared.
- `prefill`: one rank, --threads threads, cpllm (fp32 weights) and transformers' own DeepseekV2ForCausalLM forward
  (sdpa, its default experts implementation, logits_to_keep=1 as its generate prefills) on the same weights in one
  process, taking turns within every round (the side that goes first alternates).
- `dcp`: TP=2 against TP=2 x DCP=2 (one thread per rank) at one --kv-cache-memory-bytes: the KV figures from each
  engine's own accounting (the rank's pool bytes and slots, KVCapacity; the tokens the replica holds,
  LLMEngine.kv_capacity_tokens, as the start-up log prints them), then each prefills one --context prompt and the
  two take turns decoding --steps batch-1 steps per round.
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

from mla_model import SHAPES, build_folder  # noqa: E402

from cpllm.bench.common import BenchLayout, machine_info, parse_int_list, parse_layout, random_prompt  # noqa: E402
from cpllm.bench.engines import build_llm, model_config_of  # noqa: E402
from cpllm.bench.prefill import WARMUP_TOKENS, time_prefill  # noqa: E402
from cpllm.engine.sampling_params import SamplingParams  # noqa: E402


def _log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] load {os.getloadavg()[0]:.2f}  {message}", flush=True)


def timed(run, *args) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) of one run; at one thread the CPU time moves far less than the
    wall time on this shared machine."""
    cpu, start = time.process_time(), time.perf_counter()
    run(*args)
    return time.perf_counter() - start, time.process_time() - cpu


def summary(wall: dict[str, list[float]], cpu: dict[str, list[float]], base: str) -> dict[str, dict]:
    """Per side: fastest and median wall seconds, fastest CPU seconds, and `base`'s speed-up over it."""
    best = {k: min(v) for k, v in wall.items()}
    median = {k: statistics.median(v) for k, v in wall.items()}
    cpu_best = {k: min(v) for k, v in cpu.items()}
    return {k: {"best_s": round(best[k], 4), "median_s": round(median[k], 4), "cpu_s": round(cpu_best[k], 4),
                "speedup_best": round(best[k] / best[base], 3), "speedup_median": round(median[k] / median[base], 3),
                "speedup_cpu": round(cpu_best[k] / cpu_best[base], 3), "all_s": [round(t, 4) for t in wall[k]]}
            for k in wall}


# ---- layer: absorbed against expanded decode -----------------------------------------------------------------

def build_layer(folder: str, context: int):
    """Layer 0's MLAAttention on one rank with its checkpoint weights, its rotary tables, and a latent pool of
    random rows holding `context` tokens plus the new one."""
    from cpllm.distributed.parallel_context import ParallelContext
    from cpllm.layers.mla.backend import latent_pool
    from cpllm.model.loaders.loader import open_weights
    from cpllm.layers.mla.attention import MLAAttention
    from cpllm.model.rope import RotaryEmbedding

    source = open_weights(folder)
    config = source.config
    mla = config.mla
    layer = MLAAttention(mla, config.hidden_size, config.num_attention_heads, mla.softmax_scale(config.rope_scaling),
                         "model.layers.0.self_attn", ParallelContext(), torch.float32)
    for module in layer.modules():
        if hasattr(module, "load"):
            module.load(source)
    rope = RotaryEmbedding(mla.qk_rope_head_dim, config.rope_theta, config.rope_scaling, context + 1)
    gen = torch.Generator().manual_seed(context)
    pool = latent_pool(context + 16, mla.kv_lora_rank, mla.qk_rope_head_dim, torch.float32)
    pool.normal_(generator=gen)  # c is RMS-normed (unit scale); the rope key of the same scale
    return layer, rope, pool, torch.randn(1, config.hidden_size, generator=gen)


def layer_part(folder: str, args) -> dict:
    from cpllm.context_parallel.kv_layout import KVLayout
    from cpllm.context_parallel.metadata import build_step_batch
    from cpllm.context_parallel.plan import RankCapabilities, plan_step
    from cpllm.step import ScheduledChunk

    torch.set_num_threads(args.threads)
    rows = []
    for context in parse_int_list(args.contexts, "--contexts"):
        layer, rope, pool, x = build_layer(folder, context)
        block = 16
        chunk = ScheduledChunk(request_id="a", token_ids=(1,), start_pos=context,
                               block_table=tuple(range(context // block + 1)), sample=True, prompt_logits=False)
        layout = KVLayout(num_shards=1, shard_rank=0, interleave=1, block_size=block)
        batch = build_step_batch([chunk], layout, 1, 0, lambda c: [], plan=plan_step([chunk], RankCapabilities()))
        tables = rope.tables(batch.positions, torch.float32)
        new_slots, context_slots = torch.tensor([context]), torch.arange(context)
        outputs = {}

        def absorbed():
            outputs["absorbed"] = layer(x, tables, (pool, pool), batch.attention)

        def expanded():
            outputs["expanded"] = layer.forward_expanded(x, tables, pool, new_slots, context_slots)

        runs = {"absorbed": absorbed, "expanded": expanded}
        wall: dict[str, list[float]] = {k: [] for k in runs}
        cpu: dict[str, list[float]] = {k: [] for k in runs}
        with torch.inference_mode():
            for run in runs.values():
                run()  # warm-up
            for r in range(args.rounds):
                for name in list(runs)[::1 if r % 2 == 0 else -1]:
                    w, c = timed(runs[name])
                    wall[name].append(w)
                    cpu[name].append(c)
                _log(f"layer {context}: round {r}: " + ", ".join(f"{k} {v[-1] * 1e3:.1f} ms" for k, v in wall.items()))
        diff = (outputs["absorbed"] - outputs["expanded"]).abs().max().item()
        scale = outputs["expanded"].abs().max().item()
        for name, s in summary(wall, cpu, "absorbed").items():
            rows.append({"form": name, "context_tokens": context, "threads": args.threads, **s,
                         "tokens_per_s": round(1 / s["best_s"], 2), "max_abs_diff": diff, "max_abs_out": scale})
        del layer, pool
    return {"layer": rows}


# ---- prefill: cpllm against transformers ---------------------------------------------------------------------

def time_transformers(model, prompt: list[int]) -> None:
    with torch.inference_mode():
        model(input_ids=torch.tensor([prompt]), logits_to_keep=1).logits[0, -1].argmax()  # generate's prefill


def prefill_part(folder: str, args) -> dict:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    lengths = parse_int_list(args.lengths, "--lengths")
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()
    experts = hf.config._experts_implementation  # transformers' default choice
    llm, _ = build_llm(folder, BenchLayout.of(threads_per_rank=args.threads), strategy=None,
                       threads_per_rank=args.threads, context_tokens=max(lengths) + 64,
                       batch_tokens=max(lengths) + 64, engine_options=dict(quantization="none"))
    hf_name = f"transformers ({experts} experts)"
    runs = {"cpllm": lambda p: time_prefill(llm, p), hf_name: lambda p: time_transformers(hf, p)}
    vocab, rows = hf.config.vocab_size, []
    try:
        for run in runs.values():
            run(random_prompt(WARMUP_TOKENS, vocab, seed=-1))
        for n in lengths:
            wall: dict[str, list[float]] = {k: [] for k in runs}
            cpu: dict[str, list[float]] = {k: [] for k in runs}
            for r in range(args.rounds):
                prompt = random_prompt(n, vocab, seed=1000 * n + r)  # the same prompt for both in a round
                for name in list(runs)[::1 if r % 2 == 0 else -1]:
                    w, c = timed(runs[name], prompt)
                    wall[name].append(w)
                    cpu[name].append(c)
                _log(f"prefill {n} round {r}: " + ", ".join(f"{k} {v[-1]:.2f} s (cpu {cpu[k][-1]:.2f} s)"
                                                            for k, v in wall.items()))
            for name, s in summary(wall, cpu, "cpllm").items():
                rows.append({"system": name, "threads": args.threads, "prompt_tokens": n, **s,
                             "tokens_per_s": round(n / s["best_s"], 1)})
    finally:
        llm.shutdown()
    return {"prefill": rows}


# ---- dcp: TP=2 x DCP=2 against TP=2 ------------------------------------------------------------------------

class DecodeSide:
    """One engine of `layout` holding one prefilled request of `context` tokens, stepping it on demand."""

    def __init__(self, layout: str, folder: str, args):
        steps = args.steps * (args.rounds + 1) + 8
        self.name, parsed = layout, parse_layout(layout)
        self.llm, _ = build_llm(folder, parsed, strategy=None, threads_per_rank=parsed.threads_per_rank,
                                context_tokens=args.context + steps + 16, batch_tokens=args.chunk,
                                engine_options=dict(quantization="none", max_num_seqs=1,
                                                    kv_cache_memory_bytes=args.kv_bytes))
        self.engine = engine = self.llm.engine
        kv = engine.executor.rank_info.kv
        slots = kv.num_blocks * kv.block_size
        self.kv = {"kv_cache_memory_bytes": args.kv_bytes, "pool_bytes_per_rank": kv.bytes,
                   "slots_per_rank": slots, "bytes_per_token_stored": kv.bytes // slots,
                   "kv_shard_ranks": engine.config.parallel.dims.kv_shard_size,
                   "bytes_per_token_per_rank": round(kv.bytes / slots / engine.config.parallel.dims.kv_shard_size, 1),
                   "tokens_held": engine.kv_capacity_tokens, "dtype": kv.dtype}
        vocab = model_config_of(folder).vocab_size
        params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
        start = time.perf_counter()
        engine.add_request(self.name, random_prompt(args.context, vocab, seed=args.context), params)
        while not any(o.outputs[0].token_ids for o in engine.step()):
            pass  # until the first token: the whole prompt is in the cache
        self.prefill_s = time.perf_counter() - start
        self.step_s: list[float] = []

    def decode(self, steps: int) -> float:
        start = time.perf_counter()
        for _ in range(steps):
            self.engine.step()
        seconds = time.perf_counter() - start
        self.step_s.append(seconds / steps)
        return seconds

    def close(self) -> None:
        self.engine.abort_request(self.name)
        self.llm.shutdown()


READY = "@@mla-side "
"""Prefix of the lines a side process answers with (the rest of its output is logs)."""


def side_part(folder: str, args) -> None:
    """One layout's engine in its own driver process (two engines cannot share one process's default group):
    prefill, say so, then answer `decode N` with the seconds of N steps until `quit`."""
    side = DecodeSide(args.layout, folder, args)
    print(READY + json.dumps({"kv": side.kv, "prefill_s": side.prefill_s}), flush=True)
    try:
        for line in sys.stdin:
            if line.startswith("decode"):
                print(READY + json.dumps({"seconds": side.decode(int(line.split()[1]))}), flush=True)
            else:
                break
    finally:
        side.close()


class SideProcess:
    """A side_part process, spoken to over its stdin and stdout."""

    def __init__(self, layout: str, args):
        import subprocess

        argv = [sys.executable, os.path.abspath(__file__), "--part", "side", "--layout", layout, "--out", "-"]
        for name in ("shape", "layers", "vocab", "max_positions", "rounds", "context", "chunk", "steps", "kv_bytes",
                     "cache"):
            argv += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
        self.name = layout
        self.process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.ready = self._answer()
        self.step_s: list[float] = []

    def _answer(self) -> dict:
        for line in self.process.stdout:
            if line.startswith(READY):
                return json.loads(line[len(READY):])
            print(f"  [{self.name}] {line.rstrip()}", flush=True)
        raise RuntimeError(f"the {self.name} side exited with status {self.process.wait()}")

    def decode(self, steps: int) -> float:
        self.process.stdin.write(f"decode {steps}\n")
        self.process.stdin.flush()
        seconds = self._answer()["seconds"]
        self.step_s.append(seconds / steps)
        return seconds

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.write("quit\n")
            self.process.stdin.close()
            self.process.wait(timeout=120)


def dcp_part(folder: str, args) -> dict:
    sides: list[SideProcess] = []
    rows = []
    try:
        for layout in args.layouts.split(","):  # one at a time: a prefill has the machine to itself
            sides.append(SideProcess(layout, args))
            _log(f"dcp {layout}: {sides[-1].ready['kv']}; prefilled {args.context} tokens in "
                 f"{sides[-1].ready['prefill_s']:.1f} s")
        for side in sides:
            side.decode(args.steps)  # warm-up
        for r in range(args.rounds):
            for side in sides[::1 if r % 2 == 0 else -1]:
                seconds = side.decode(args.steps)
                _log(f"dcp {side.name} round {r}: {args.steps / seconds:.2f} tok/s")
        for side in sides:
            rates = [1 / s for s in side.step_s[1:]]
            rows.append({"layout": side.name, "context_tokens": args.context, "steps": args.steps,
                         "tokens_per_s": round(statistics.median(rates), 3),
                         "tokens_per_s_rounds": [round(x, 3) for x in rates],
                         "prefill_s": round(side.ready["prefill_s"], 1), "kv": side.ready["kv"]})
        base = rows[0]
        for row in rows:
            row["ratio_to_first"] = round(row["tokens_per_s"] / base["tokens_per_s"], 3)
            row["ratio_rounds"] = [round(a / b, 3) for a, b in zip(row["tokens_per_s_rounds"],
                                                                    base["tokens_per_s_rounds"])]
    finally:
        for side in sides:
            side.close()
    return {"dcp": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("layer", "prefill", "dcp", "side"), required=True,
                        help="side: one layout's engine for the dcp part (started by it)")
    parser.add_argument("--layout", default="2x1x1@1", help="side: its layout")
    parser.add_argument("--shape", choices=tuple(SHAPES), default="v2-lite", help="tiny: the smoke test's")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers: the first dense, the rest sparse")
    parser.add_argument("--vocab", type=int, default=32768, help="vocabulary (DeepSeek-V2-Lite: 102400)")
    parser.add_argument("--max-positions", type=int, default=16896)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the one-rank parts")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--contexts", default="2048,16384", help="layer: decode contexts")
    parser.add_argument("--lengths", default="2048", help="prefill: prompt lengths")
    parser.add_argument("--layouts", default="2x1x1@1,2x1x2@1", help="dcp: the compared layouts, base first")
    parser.add_argument("--context", type=int, default=16384, help="dcp: context tokens")
    parser.add_argument("--chunk", type=int, default=4096, help="dcp: prefill chunk (max_num_batched_tokens)")
    parser.add_argument("--steps", type=int, default=8, help="dcp: decode steps per round")
    parser.add_argument("--kv-bytes", type=int, default=80 * 2**20, help="dcp: --kv-cache-memory-bytes of both")
    parser.add_argument("--cache", default="/tmp/cpllm-mla-bench")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    folder = build_folder(args.cache, args.layers, args.vocab, args.max_positions, args.shape)
    if args.part == "side":
        return side_part(folder, args)
    machine = machine_info()
    machine["load_average_start"] = machine.pop("load_average")
    data = {"layer": layer_part, "prefill": prefill_part, "dcp": dcp_part}[args.part](folder, args)
    machine["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    fields = SHAPES[args.shape]
    model = {"shape": args.shape, "layers": args.layers, "vocab": args.vocab,
             **{k: fields[k] for k in ("hidden_size", "num_attention_heads", "kv_lora_rank", "qk_rope_head_dim",
                                       "qk_nope_head_dim", "v_head_dim", "n_routed_experts", "moe_intermediate_size",
                                       "num_experts_per_tok", "n_shared_experts", "intermediate_size",
                                       "first_k_dense_replace")}}
    with open(args.out, "w") as f:
        json.dump({"argv": ["python", "benchmarks/mla_bench.py", *sys.argv[1:]], "part": args.part, "model": model,
                   "rounds": args.rounds, "machine": machine, **data}, f, indent=1)
    _log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
