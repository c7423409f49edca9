"""cpllm vs transformers vs llama.cpp on SmolLM2: prefill and decode, same prompts, same threads, one run.

    python benchmarks/compare.py --lengths 1024,2048,4096,8000 --threads 1,2 \
        --decode-contexts 128,2048 --decode-batches 1,16 --out benchmarks/results/compare.json

Measurements are interleaved (for each thread count and length, every system in turn), so a change
in machine load touches every system alike. llama.cpp is skipped, with a note in the JSON, when
llama-cpp-python is not installed (it is an optional extra: it compiles for ~5-15 minutes here). Build it for the
CPU's own instructions; on a CPU with AMX, 0.3.36 with `GGML_NATIVE=ON` segfaults in its AMX int8 matmul on
SmolLM2's Q4_1 file, so there its AVX-512 paths are named and AMX left off:

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
        -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
        -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" pip install llama-cpp-python==0.3.36
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from systems import CpllmRunner, LlamaCppRunner, TransformersRunner, llama_cpp_available  # noqa: E402

from cpllm.bench.ceiling import measure_ceilings, prefill_flops  # noqa: E402
from cpllm.bench.common import machine_info, parse_int_list, random_prompt  # noqa: E402
from cpllm.bench.engines import model_config_of  # noqa: E402
from cpllm.bench.report import print_table, write_json  # noqa: E402
from cpllm.model.loaders.default_model import default_model_path  # noqa: E402


def _log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] load {os.getloadavg()[0]:.2f}  {message}", flush=True)


def load_runners(model: str, max_tokens: int, max_batch: int, decode_tokens: int,
                 skip: set[str], compiled: bool) -> tuple[list, list[str]]:
    notes = []
    runners = []
    if "cpllm" not in skip:
        runners.append(CpllmRunner(model, max_tokens, max_batch, decode_tokens, quantization="none"))
        runners.append(CpllmRunner(model, max_tokens, max_batch, decode_tokens, quantization="auto"))
        if compiled:  # decode only; auto with float16 K/V as llama.cpp stores them
            runners.append(CpllmRunner(model, max_tokens, max_batch, decode_tokens, quantization="none",
                                       compile_decode=True))
            runners.append(CpllmRunner(model, max_tokens, max_batch, decode_tokens, quantization="auto",
                                       compile_decode=True, kv_cache_dtype="float16"))
    if "transformers" not in skip:
        runners.append(TransformersRunner(model))
    if "transformers-bf16" not in skip:  # the fastest CPU dtype where the CPU has bf16 dot products or tiles
        runners.append(TransformersRunner(model, torch.bfloat16))
    if "llama.cpp" in skip:
        pass
    elif llama_cpp_available():
        runners.append(LlamaCppRunner(model, max_tokens))
    else:
        notes.append("llama.cpp skipped: llama-cpp-python is not installed "
                     "(pip install llama-cpp-python==0.3.36, ~15 min build)")
    return runners, notes


def run_prefill(runners, config, lengths: list[int], threads: list[int], repeats: int) -> list[dict]:
    """Each (threads, length) cell is measured `repeats` times, every system once per round in turn; the row
    keeps the fastest round (`ttft_s`) and the median (`ttft_median_s`)."""
    rows = []
    runners = [r for r in runners if not getattr(r, "decode_only", False)]
    for t in threads:
        for runner in runners:
            runner.set_threads(t)
            runner.prefill_s(random_prompt(64, config.vocab_size, seed=-1))  # warm-up
        for length in lengths:
            prompt = random_prompt(length, config.vocab_size, seed=length)  # the same prompt for everyone
            times: dict[str, list[float]] = {runner.name: [] for runner in runners}
            for round_index in range(repeats):
                for runner in runners:
                    runner.set_threads(t)
                    times[runner.name].append(runner.prefill_s(prompt))
                    _log(f"prefill {runner.name} {t}t {length} round {round_index}: {times[runner.name][-1]:.2f} s")
            # every system computes the LM head on the last position only (transformers as its generate does)
            flops = prefill_flops(config, length, logits_rows=1).total
            for runner in runners:
                best, median = min(times[runner.name]), sorted(times[runner.name])[len(times[runner.name]) // 2]
                rows.append({"system": runner.name, "layout": f"{t} thread{'s' * (t > 1)}", "threads": t,
                             "prompt_tokens": length, "ttft_s": round(best, 4), "ttft_median_s": round(median, 4),
                             "tokens_per_s": round(length / best, 1), "gflops": round(flops / best / 1e9, 1)})
    return rows


def run_decode(runners, config, contexts: list[int], batches: list[int], threads: list[int],
               steps: int) -> list[dict]:
    return [row for t in threads for row in _decode_at(runners, config, contexts, batches, t, steps)]


def _decode_at(runners, config, contexts: list[int], batches: list[int], threads: int, steps: int) -> list[dict]:
    rows = []
    for runner in runners:
        runner.set_threads(threads)
    for context in contexts:
        prompt = random_prompt(context, config.vocab_size, seed=context + 7)
        for batch in batches:
            for runner in runners:
                if runner.name.startswith(("llama.cpp", "transformers")) and batch > 1:
                    continue  # llama-cpp-python decodes one sequence; the targets compare with transformers' batch 1
                seconds = runner.decode_s(prompt, batch, steps)
                rows.append({"system": runner.name, "layout": f"{threads} threads", "threads": threads,
                             "batch_size": batch, "context_tokens": context,
                             "tokens_per_s": round(batch * steps / seconds, 2),
                             "step_ms": round(1000 * seconds / steps, 2)})
                _log(f"decode {runner.name} batch {batch} context {context}: {batch * steps / seconds:.1f} tok/s")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="GGUF file (default: SmolLM2-135M-Instruct Q4_1)")
    parser.add_argument("--lengths", default="1024,2048,4096,8000")
    parser.add_argument("--threads", default="1,2", help="total CPU threads per system, comma-separated")
    parser.add_argument("--prefill-repeats", type=int, default=3,
                        help="rounds per prefill cell (every system once per round); rows keep the fastest")
    parser.add_argument("--decode-contexts", default="128,2048")
    parser.add_argument("--decode-batches", default="1,16")
    parser.add_argument("--decode-threads", default="2", help="total CPU threads for decode, comma-separated")
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--skip", default="", help="systems to leave out, comma-separated")
    parser.add_argument("--no-compiled", action="store_true",
                        help="leave out the --compile-decode runners (each compiles for about a minute first)")
    parser.add_argument("--out", default="benchmarks/results/compare.json")
    args = parser.parse_args()

    model = args.model or default_model_path()
    config = model_config_of(model)
    lengths = parse_int_list(args.lengths, "--lengths")
    threads = parse_int_list(args.threads, "--threads")
    contexts = parse_int_list(args.decode_contexts, "--decode-contexts")
    batches = parse_int_list(args.decode_batches, "--decode-batches")
    decode_threads = parse_int_list(args.decode_threads, "--decode-threads")
    decode_tokens = max(contexts) + args.decode_steps + 80  # time_decode's max_tokens is steps + 64
    max_tokens = min(max(max(lengths), decode_tokens) + 16, config.max_position_embeddings)
    machine = machine_info()
    ceilings = measure_ceilings(sorted(set(threads) | set(decode_threads)))
    _log(f"ceilings {ceilings}")
    runners, notes = load_runners(model, max_tokens, max(batches), decode_tokens,
                                  {s for s in args.skip.split(",") if s}, compiled=not args.no_compiled)
    try:
        prefill = run_prefill(runners, config, lengths, threads, args.prefill_repeats)
        decode = run_decode(runners, config, contexts, batches, decode_threads, args.decode_steps)
    finally:
        for runner in runners:
            runner.close()
    for row in prefill:
        row["ceiling_fraction"] = round(row["gflops"] / ceilings[row["threads"]]["matmul_gflops"], 3)
    print_table("prefill", prefill)
    print_table("decode", decode)
    machine["load_average_start"] = machine.pop("load_average")
    machine["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    write_json(args.out, {"command": "compare", "argv": sys.argv[1:], "machine": machine, "notes": notes,
                          "model": os.path.basename(model), "ceilings": {str(k): v for k, v in ceilings.items()},
                          "prefill": prefill, "decode": decode})


if __name__ == "__main__":
    main()
