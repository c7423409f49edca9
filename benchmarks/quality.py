"""How far each approximate weight format is from the float32 one (`none`): greedy agreement and log-likelihood.

    python benchmarks/quality.py --out benchmarks/results/quality.json

For each format (cpllm `auto`, and llama.cpp on the same GGUF file when llama-cpp-python is installed):
- greedy agreement with cpllm `none` over PROMPTS (the same prompt token ids, MAX_TOKENS greedy tokens each):
  how many completions are identical, and the mean share of each completion before its first differing token;
- the mean per-token log-likelihood of TEXT, and its mean difference from `none`'s (per token, same ids);
- the same over LONG_TOKENS tokens (TEXT's ids repeated): a prefill long enough for the prefill paths (the int4
  layers' dequantized GEMMs, bf16 GEMMs and attention where the CPU has bf16 dot products). Its repeats are easy to
  predict, so its mean difference is diluted; TEXT's is the per-token figure.
The notes say which int4 kernel ran TEXT (its ~111 rows sit near the measured threshold):
`CPLLM_INT4_GEMM_FROM_ROWS=64` or `=never` runs it on the GEMMs or on the integer kernel.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from systems import llama_cpp_available  # noqa: E402

from cpllm.bench.common import machine_info  # noqa: E402
from cpllm.bench.report import print_table, write_json  # noqa: E402
from cpllm.engine.llm import LLM  # noqa: E402
from cpllm.engine.sampling_params import SamplingParams  # noqa: E402
from cpllm.kernels import int4_choice  # noqa: E402
from cpllm.model.loaders.default_model import default_model_path  # noqa: E402

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers greater than 20.",
    "Translate 'good morning' into Spanish and German.",
    "Give me a short recipe for pancakes.",
    "What does a compiler do?",
    "Summarize the plot of Romeo and Juliet in one sentence.",
]
MAX_TOKENS = 48
LONG_TOKENS = 2048
"""Tokens of the long scored text."""
TEXT = (
    "The river rose slowly through the night, and by morning the lower fields were under water. The farmers "
    "gathered on the bridge to watch, talking quietly about the harvest they had hoped to bring in that week. "
    "Some of them had seen floods before and knew the water would fall again within a few days; others, younger, "
    "worried about the seed they had stored in the barns near the bank. By noon the rain had stopped, the clouds "
    "broke apart, and the sun came out over a landscape that looked, for a while, like a great silver lake."
)


def chat_ids(llm: LLM, prompt: str) -> list[int]:
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    return llm.tokenizer.encode(text, add_special_tokens=False)


def cpllm_results(model: str, quantization: str, threads: int) -> dict:
    with LLM(model, quantization=quantization, max_model_len=LONG_TOKENS + 64, kv_cache_memory_bytes=256 << 20,
             threads_per_rank=threads) as llm:
        prompts = [chat_ids(llm, p) for p in PROMPTS]
        greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)
        ids = llm.tokenizer.encode(TEXT)
        long_ids = (ids * (LONG_TOKENS // len(ids) + 1))[:LONG_TOKENS]
        # one call each: in one step the short text's rows would join the long one's in its GEMMs
        scored = [llm.generate([{"prompt_token_ids": tokens}], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
                  for tokens in (ids, long_ids)]
    logprobs = [[out.prompt_logprobs[i][tokens[i]].logprob for i in range(1, len(tokens))]
                for out, tokens in zip(scored, (ids, long_ids))]
    return {"prompts": prompts, "completions": [list(o.outputs[0].token_ids) for o in outs], "text_ids": ids,
            "logprobs": logprobs[0], "long_ids": long_ids, "long_logprobs": logprobs[1]}


def llama_cpp_results(model: str, prompts: list[list[int]], text_ids: list[int], long_ids: list[int],
                      threads: int) -> dict:
    import numpy as np
    from llama_cpp import Llama

    llm = Llama(model_path=model, n_ctx=LONG_TOKENS + 64, n_batch=512, n_threads=threads, n_threads_batch=threads,
                logits_all=True, verbose=False)
    completions = []
    for prompt in prompts:
        llm.reset()
        llm.eval(prompt)
        tokens = []
        for _ in range(MAX_TOKENS):
            tokens.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
            llm.eval([tokens[-1]])
        completions.append(tokens)
    return {"completions": completions, "logprobs": _llama_cpp_logprobs(llm, text_ids),
            "long_logprobs": _llama_cpp_logprobs(llm, long_ids)}


def _llama_cpp_logprobs(llm, ids: list[int]) -> list[float]:
    """Each token's logprob after the ones before it, from one evaluation of `ids`."""
    import numpy as np

    llm.reset()
    llm.eval(ids)
    scores = np.asarray(llm.scores[: len(ids)], dtype=np.float64)  # [n, vocab]
    top = scores.max(axis=1, keepdims=True)
    log_z = (top + np.log(np.exp(scores - top).sum(axis=1, keepdims=True)))[:, 0]
    return [float(scores[i - 1, ids[i]] - log_z[i - 1]) for i in range(1, len(ids))]


def int4_note(text_tokens: int) -> str:
    """Which int4 kernel ran the scored text in this process: the threshold is measured at start-up (or set by
    CPLLM_INT4_GEMM_FROM_ROWS), and the short text's rows fall on either side of it."""
    choice = int4_choice.choose()
    if not choice.gemm_dtype or choice.gemm_from_rows == int4_choice.NEVER:
        return f"int4 layers: the {choice.backend} kernel at every row count"
    tiles = " fed straight from the int4 records" if text_tokens < choice.records_below else ""
    ran = (f"{choice.gemm_dtype} GEMMs{tiles}" if text_tokens >= choice.gemm_from_rows
           else f"the {choice.backend} integer kernel")
    return (f"int4 layers: {choice.gemm_dtype} GEMMs from {choice.gemm_from_rows} rows, so the {text_tokens}-token "
            f"text ran {ran}")


def compare(name: str, result: dict, reference: dict) -> dict:
    same, shares = 0, []
    for got, want in zip(result["completions"], reference["completions"]):
        prefix = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        same += got == want
        shares.append(prefix / len(want))
    diffs = [a - b for a, b in zip(result["logprobs"], reference["logprobs"])]
    long_diffs = [abs(a - b) for a, b in zip(result["long_logprobs"], reference["long_logprobs"])]
    return {"system": name, "prompts": len(shares), "identical_completions": same,
            "agreement": round(sum(shares) / len(shares), 3),
            "mean_logprob": round(sum(result["logprobs"]) / len(result["logprobs"]), 4),
            "mean_logprob_diff": round(sum(diffs) / len(diffs), 4),
            "mean_abs_logprob_diff": round(sum(abs(d) for d in diffs) / len(diffs), 4),
            "perplexity": round(math.exp(-sum(result["logprobs"]) / len(result["logprobs"])), 3),
            f"mean_abs_logprob_diff_{LONG_TOKENS}": round(sum(long_diffs) / len(long_diffs), 4),
            f"max_abs_logprob_diff_{LONG_TOKENS}": round(max(long_diffs), 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="GGUF file (default: SmolLM2-135M-Instruct Q4_1)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--formats", default="auto", help="cpllm formats compared with none, comma-separated")
    parser.add_argument("--out", default="benchmarks/results/quality.json")
    args = parser.parse_args()
    model = args.model or default_model_path()
    reference = cpllm_results(model, "none", args.threads)
    rows, notes = [compare("cpllm (none)", reference, reference)], []
    for fmt in [f for f in args.formats.split(",") if f]:
        rows.append(compare(f"cpllm ({fmt})", cpllm_results(model, fmt, args.threads), reference))
    if llama_cpp_available():
        rows.append(compare("llama.cpp", llama_cpp_results(model, reference["prompts"], reference["text_ids"],
                                                           reference["long_ids"], args.threads), reference))
    else:
        notes.append("llama.cpp skipped: llama-cpp-python is not installed (pip install llama-cpp-python==0.3.36)")
    notes.append(int4_note(len(reference["text_ids"])))
    print_table("quality against cpllm none (float32)", rows)
    print("\n".join(notes))
    write_json(args.out, {"command": "quality", "argv": sys.argv[1:], "machine": machine_info(), "notes": notes,
                          "model": os.path.basename(model), "max_tokens": MAX_TOKENS, "text_tokens":
                          len(reference["text_ids"]), "rows": rows})


if __name__ == "__main__":
    main()
