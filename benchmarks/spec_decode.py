"""Prompt-lookup speculative decoding on SmolLM2 (its default weights), batch 1: output tokens/s against no
speculation, the acceptance rate and the mean tokens per verify step.

    python benchmarks/spec_decode.py --json benchmarks/results/spec_decode.json [--pcp 2] [--ks 2 4 8] [--batch 16]

Two workloads, greedy, chat template: "copy", a document of ~1.5K tokens (this repository's
docs/architecture.md, its first sections) and a request to rewrite it with one change, so most of the answer copies
the prompt; "chat", a short free-form question, where drafts are few and mostly wrong (speculation must cost little).
Every configuration is its own engine, all built up front in this process; each request runs once per engine to
warm up (which also leaves its prompt in the prefix cache; `--warmup 0` skips it), then `--repeats` rounds run every configuration in
turn, so a change in the machine's load reaches them alike. Reported: the median and the best decode rate (on a
shared machine the best round is the least disturbed one), output tokens after
the first over the time from the first token to the last (prefill is the same work in every configuration).
With `--batch B` each workload is B different requests run together (B documents cut from docs/architecture.md,
docs/context_parallel.md and docs/serve.md in turn; B different chat questions): the rate is every request's output
tokens after its first over the time from the first request's first token to the last one's end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

from cpllm import LLM, SamplingParams
from cpllm.bench.common import machine_info

HERE = os.path.dirname(os.path.abspath(__file__))
CHAT = "Tell me a short story about a lighthouse keeper and a storm."
CHATS = [CHAT, "What should I pack for a week of hiking in the mountains?", "Explain how a bicycle stays upright.",
         "Write a poem about autumn leaves.", "Why is the sky blue? Answer for a ten-year-old.",
         "Give me three ideas for a birthday party for my grandmother.", "How do I make a good cup of tea?",
         "Describe a day in the life of a medieval blacksmith.", "What are the pros and cons of working from home?",
         "Tell me a story about a dragon who is afraid of the dark.", "How do bees make honey?",
         "Suggest a weekly plan to start running.", "What is the difference between weather and climate?",
         "Write a letter to a friend who moved to another country.", "Explain recursion to a beginner programmer.",
         "Describe your ideal city of the future."]
"""Free-form questions: the chat workload takes the first --batch of them."""
DOCUMENTS = ("architecture.md", "context_parallel.md", "serve.md")
"""The docs the copy workload's documents are cut from, in turn."""


def copy_prompts(tokenizer, target_tokens: int, count: int) -> list[str]:
    """`count` rewrite requests, each over ~target_tokens tokens of whole paragraphs, the first from the start of
    docs/architecture.md, the later ones the next paragraphs of the docs in turn."""
    paragraphs = []
    for name in DOCUMENTS:
        with open(os.path.join(HERE, "..", "docs", name)) as f:
            paragraphs += f.read().split("\n\n")
    prompts, document = [], ""
    for paragraph in paragraphs:
        if len(tokenizer.encode(document + paragraph)) > target_tokens:
            prompts.append("Rewrite the following text exactly as it is, except that every occurrence of the word "
                           "'rank' becomes 'worker'.\n\n" + document.strip())
            if len(prompts) == count:
                return prompts
            document = ""
        document += paragraph + "\n\n"
    raise ValueError(f"the docs hold {len(prompts)} documents of {target_tokens} tokens, not --batch {count}")


def token_ids(llm: LLM, prompt: str) -> dict:
    tokenizer = llm.get_tokenizer()
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    return {"prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}


def decode_rate(llm: LLM, ids: list[dict], params: SamplingParams) -> tuple[float, list[list[int]]]:
    """Output tokens after each request's first over the time from the first first token to the last end."""
    results = llm.generate(ids, params)
    first = min(r.metrics.first_token_time for r in results)
    last = max(r.metrics.finished_time for r in results)
    outputs = [list(r.outputs[0].token_ids) for r in results]
    return sum(len(out) - 1 for out in outputs) / (last - first), outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--pcp", type=int, default=1)
    parser.add_argument("--doc-tokens", type=int, default=1500)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, choices=(0, 1), default=1, help="one unmeasured run per engine first")
    parser.add_argument("--threads-per-rank", type=int, default=None)
    parser.add_argument("--workloads", nargs="+", choices=("copy", "chat"), default=["copy", "chat"])
    parser.add_argument("--batch", type=int, default=1, help="requests per workload, run together")
    parser.add_argument("--draft-length", choices=("adaptive", "fixed"), default="adaptive",
                        help="speculative_config draft_length (fixed: always up to k, as vLLM)")
    parser.add_argument("--kv-cache-memory", type=int, default=256 << 20, help="KV pool bytes per engine")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not 1 <= args.batch <= len(CHATS):
        parser.error(f"--batch {args.batch} must be in [1, {len(CHATS)}] (the chat questions there are)")
    results = {"machine": machine_info(), "pcp": args.pcp, "batch": args.batch, "max_tokens": args.max_tokens,
               "draft_length": args.draft_length, "runs": []}
    engines = {}
    for k in [0, *args.ks]:
        spec = None if k == 0 else {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4,
                                    "prompt_lookup_min": 2, "draft_length": args.draft_length}
        engines[k] = LLM(prefill_context_parallel_size=args.pcp, max_model_len=4096, speculative_config=spec,
                         kv_cache_memory_bytes=args.kv_cache_memory, threads_per_rank=args.threads_per_rank)
    tokenizer_llm = engines[0]
    prompts = {"copy": copy_prompts(tokenizer_llm.get_tokenizer(), args.doc_tokens, args.batch),
               "chat": CHATS[: args.batch]}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    for workload, prompt in prompts.items():
        if workload not in args.workloads:
            continue
        ids = [token_ids(tokenizer_llm, p) for p in prompt]
        before, rates, outputs = {}, {k: [] for k in engines}, {}
        for k, llm in engines.items():
            if args.warmup:
                decode_rate(llm, ids, params)  # prefix cache filled; the decode rate leaves prefill out anyway
            before[k] = llm.engine.spec_decode_totals
        for _ in range(args.repeats):
            for k, llm in engines.items():
                rate, outputs[k] = decode_rate(llm, ids, params)
                rates[k].append(rate)
        for k, llm in engines.items():
            after = llm.engine.spec_decode_totals
            drafted = after.num_draft_tokens - before[k].num_draft_tokens
            accepted = after.num_accepted_tokens - before[k].num_accepted_tokens
            steps = after.num_drafts - before[k].num_drafts
            result = dict(k=k, workload=workload, prompt_tokens=sum(len(i["prompt_token_ids"]) for i in ids),
                          output_tokens=sum(len(out) for out in outputs[k]),
                          tokens_after_first=sum(len(out) - 1 for out in outputs[k]),
                          tokens_per_s=statistics.median(rates[k]), rates=rates[k],
                          best_tokens_per_s=max(rates[k]),
                          output=outputs[k], draft_tokens=drafted, accepted_tokens=accepted, verify_steps=steps,
                          acceptance_rate=accepted / drafted if drafted else None,
                          mean_accepted_per_verify=accepted / steps if steps else None)
            results["runs"].append(result)
            print(f"k={k} {workload}: {result['prompt_tokens']} prompt tokens, {result['output_tokens']} out, "
                  f"{result['tokens_per_s']:.1f} tok/s, acceptance {result['acceptance_rate']}, "
                  f"accepted/verify {result['mean_accepted_per_verify']}", flush=True)
    for llm in engines.values():
        llm.shutdown()
    base = {r["workload"]: r for r in results["runs"] if r["k"] == 0}
    for r in results["runs"]:
        r["speedup"] = r["tokens_per_s"] / base[r["workload"]]["tokens_per_s"]
        r["best_speedup"] = r["best_tokens_per_s"] / base[r["workload"]]["best_tokens_per_s"]
        r["same_output"] = r["output"] == base[r["workload"]]["output"]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
