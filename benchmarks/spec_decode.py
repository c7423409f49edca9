"""Prompt-lookup speculative decoding on SmolLM2 (its default weights): output tokens/s against no speculation,
the acceptance rate and the mean tokens per verify step.

    python benchmarks/spec_decode.py --json benchmarks/results/spec_decode.json [--pcp 2] [--ks 2 4 8] [--batch 16]

Two workloads, greedy, chat template: "copy", a document of ~1.5K tokens (this repository's
docs/architecture.md, its first sections) and a request to rewrite it with one change, so most of the answer copies
the prompt; "chat", a short free-form question, where drafts are few and mostly wrong (speculation must cost little).
Every configuration is its own engine (`Engines`: on one rank all built up front in this process, under PCP one at a
time); each request runs once per engine to warm up (which also leaves its prompt in the prefix cache; `--warmup 0`
skips it), then `--repeats` rounds run every configuration in turn, so a change in the machine's load reaches them
alike. Reported: the median and the best decode rate (on a shared machine the best round is the least disturbed
one), output tokens after the first over the time from the first token to the last (prefill is the same work in
every configuration).
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


def token_ids(tokenizer, prompt: str) -> dict:
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
    engines = Engines(args)
    tokenizer = engines.tokenizer
    prompts = {"copy": copy_prompts(tokenizer, args.doc_tokens, args.batch), "chat": CHATS[: args.batch]}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    for workload, prompt in prompts.items():
        if workload not in args.workloads:
            continue
        ids = [token_ids(tokenizer, p) for p in prompt]
        runs = {k: [] for k in engines.ks}  # k -> [(rate, outputs, (drafts, draft tokens, accepted))] per round
        for _ in range(args.repeats):
            for k in engines.ks:
                runs[k].append(engines.run(k, ids, params))
        for k in engines.ks:
            results["runs"].append(summary(k, workload, ids, runs[k]))
    engines.shutdown()
    base = {r["workload"]: r for r in results["runs"] if r["k"] == 0}
    for r in results["runs"]:
        r["speedup"] = r["tokens_per_s"] / base[r["workload"]]["tokens_per_s"]
        r["best_speedup"] = r["best_tokens_per_s"] / base[r["workload"]]["best_tokens_per_s"]
        r["same_output"] = r["output"] == base[r["workload"]]["output"]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


class Engines:
    """One engine per k. On one rank all are built up front and each request runs once per engine to warm up (which
    also leaves its prompt in the prefix cache); under PCP a process holds one world at a time, so each
    measurement builds its engine, warms it up the same way, measures and shuts it down."""

    def __init__(self, args):
        self.args, self.ks = args, [0, *args.ks]
        self.resident = {k: self._build(k) for k in self.ks} if args.pcp == 1 else {}
        self._warm: set[tuple[int, int]] = set()
        first = self.resident.get(0) or self._build(0)
        self.tokenizer = first.get_tokenizer()
        if not self.resident:
            first.shutdown()

    def _build(self, k: int) -> LLM:
        a = self.args
        spec = None if k == 0 else {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4,
                                    "prompt_lookup_min": 2, "draft_length": a.draft_length}
        return LLM(prefill_context_parallel_size=a.pcp, max_model_len=4096, speculative_config=spec,
                   kv_cache_memory_bytes=a.kv_cache_memory, threads_per_rank=a.threads_per_rank)

    def run(self, k: int, ids: list[dict], params: SamplingParams):
        """(decode rate, outputs, (verify chunks, draft tokens, accepted) of the measured run)."""
        llm = self.resident.get(k) or self._build(k)
        try:
            if self.args.warmup and (k, id(ids)) not in self._warm:
                decode_rate(llm, ids, params)
                if self.resident:
                    self._warm.add((k, id(ids)))
            before = llm.engine.spec_decode_totals
            rate, outputs = decode_rate(llm, ids, params)
            after = llm.engine.spec_decode_totals
        finally:
            if not self.resident:
                llm.shutdown()
        return rate, outputs, (after.num_drafts - before.num_drafts,
                               after.num_draft_tokens - before.num_draft_tokens,
                               after.num_accepted_tokens - before.num_accepted_tokens)

    def shutdown(self) -> None:
        for llm in self.resident.values():
            llm.shutdown()


def summary(k: int, workload: str, ids: list[dict], runs) -> dict:
    rates = [rate for rate, _, _ in runs]
    outputs = runs[-1][1]
    steps, drafted, accepted = (sum(run[2][i] for run in runs) for i in range(3))
    result = dict(k=k, workload=workload, prompt_tokens=sum(len(i["prompt_token_ids"]) for i in ids),
                  output_tokens=sum(len(out) for out in outputs),
                  tokens_after_first=sum(len(out) - 1 for out in outputs),
                  tokens_per_s=statistics.median(rates), rates=rates, best_tokens_per_s=max(rates),
                  output=outputs, draft_tokens=drafted, accepted_tokens=accepted, verify_steps=steps,
                  acceptance_rate=accepted / drafted if drafted else None,
                  mean_accepted_per_verify=accepted / steps if steps else None)
    print(f"k={k} {workload}: {result['prompt_tokens']} prompt tokens, {result['output_tokens']} out, "
          f"{result['tokens_per_s']:.1f} tok/s, acceptance {result['acceptance_rate']}, "
          f"accepted/verify {result['mean_accepted_per_verify']}", flush=True)
    return result


if __name__ == "__main__":
    main()
