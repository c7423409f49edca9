"""Where one rank's decode step goes: torch.profiler over steady decode steps, in this process.

    python benchmarks/profile_decode.py --quantization auto --batch 1 --context 128 --threads 2 --steps 32

Prints the step time (timed without the profiler: median and best of a few rounds), the aten calls per step and the
operators with the most CPU time; `--json` writes the same. One engine, single rank, greedy, EOS ignored.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from cpllm.bench.common import machine_info, random_prompt
from cpllm.bench.engines import build_llm, model_config_of
from cpllm.engine.sampling_params import SamplingParams


def _start(engine, prompts: list[list[int]], max_tokens: int, tag: str) -> list[str]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    started: set[str] = set()
    while len(started) < len(ids):
        started.update(o.request_id for o in engine.step() if o.outputs[0].token_ids)
    return ids


def _finish(engine, ids: list[str]) -> None:
    for request_id in ids:
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()


def time_steps(engine, prompts, steps: int, tag: str) -> float:
    """Seconds per decode step of the whole batch (after prefill)."""
    ids = _start(engine, prompts, steps + 8, tag)
    begin = time.perf_counter()
    for _ in range(steps):
        engine.step()
    seconds = (time.perf_counter() - begin) / steps
    _finish(engine, ids)
    return seconds


def profile_steps(engine, prompts, steps: int, top: int) -> tuple[list[dict], float]:
    """Operator table (self CPU time summed over `steps` steps) and aten calls per step."""
    ids = _start(engine, prompts, steps + 8, "profile")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    _finish(engine, ids)
    events = [e for e in prof.key_averages() if e.key.startswith("aten::")]
    total_self = sum(e.self_cpu_time_total for e in events) or 1.0
    calls = sum(e.count for e in events) / steps
    rows = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    table = [{"op": e.key, "calls_per_step": round(e.count / steps, 1),
              "self_ms_per_step": round(e.self_cpu_time_total / 1000 / steps, 3),
              "share": round(e.self_cpu_time_total / total_self, 3)} for e in rows]
    return table, calls


def _one_rank_layout():
    # benchmarks/profile_before_after.py runs this file on an older commit's cpllm too, whose bench layout type was
    # `Layout` before the parallel dims (issue 24)
    try:
        from cpllm.bench.common import BenchLayout
    except ImportError:
        from cpllm.bench.common import Layout
        return Layout(tp=1, pcp=1, dcp=1)
    return BenchLayout.of(tp=1, pcp=1, dcp=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds (median reported)")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--compile-decode", action="store_true", help="decode steps through torch.compile")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    config = model_config_of(args.model)
    longest = args.context + args.steps + 64
    options = {"quantization": args.quantization, "max_model_len": longest, "max_num_seqs": max(args.batch, 1)}
    # only options that differ from the defaults: profile_before_after.py runs this against older trees too
    if args.compile_decode:
        options["compile_decode"] = True
    if args.kv_cache_dtype != "auto":
        options["kv_cache_dtype"] = args.kv_cache_dtype
    llm, _ = build_llm(args.model, _one_rank_layout(), strategy=None, threads_per_rank=args.threads,
                       context_tokens=longest * args.batch, batch_tokens=max(4096, longest), engine_options=options)
    torch.set_num_threads(args.threads)
    prompts = [random_prompt(args.context, config.vocab_size, seed=args.context * 1000 + i)
               for i in range(args.batch)]
    try:
        time_steps(llm.engine, prompts, 4, "warmup")
        rounds = [time_steps(llm.engine, prompts, args.steps, f"t{r}") for r in range(args.rounds)]
        step_s, best_s = statistics.median(rounds), min(rounds)
        table, calls = ([], 0.0) if args.no_profile else profile_steps(llm.engine, prompts, args.steps, args.top)
    finally:
        llm.shutdown()
    print(f"compile_decode={args.compile_decode} kv_cache_dtype={args.kv_cache_dtype} quantization={args.quantization} batch={args.batch} context={args.context} threads={args.threads}: "
          f"{1000 * step_s:.2f} ms/step (best {1000 * best_s:.2f}), {args.batch / step_s:.1f} tok/s, "
          f"{calls:.0f} aten calls/step")
    for row in table:
        print(f"  {row['op']:<48} {row['calls_per_step']:>8} calls {row['self_ms_per_step']:>8.3f} ms "
              f"{100 * row['share']:5.1f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": sys.argv[1:], "machine": machine_info(), "step_ms": round(1000 * step_s, 3),
                       "best_step_ms": round(1000 * best_s, 3), "aten_calls_per_step": round(calls), "ops": table},
                      f, indent=2)


if __name__ == "__main__":
    main()
