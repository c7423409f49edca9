"""The time of a speculative verify step (k drafts per request) on the decode path against the prefill path, under
PCP=2 and TP=2 x DCP=2, side by side in one run.

A verify chunk (a request's last token and its k drafts) runs either as k + 1 single-token decode rows, which take
the layout's decode plan (a decode team, the fused layers, or the eager decode plan: cpllm/worker/runner.py
`_verify_rows`), or as a prefill chunk of k + 1 tokens with the eager prefill plan. Here both are built by hand and
sent to every rank through the replica's executor: the decode path as the verify chunk itself
(`num_draft_tokens = k`), the prefill path as the same tokens in a chunk that returns every row's logits
(`prompt_logits`), which is what the prefill path computes for a verify chunk. A plain decode step (one token per
request) is timed beside them for scale. Each request first gets a context of `--context` tokens (prefill chunks
through the same executor); every verify step then rewrites positions context .. context + k of its requests.

The model is small but not trivial: 8 Llama layers, hidden 256, 8 query heads of 32, one KV head (so DCP=2 under
TP=2 holds), MLP 768, random weights, the tests' tiny tokenizer. `--quantization int4` (quantized at load): the fused
layers take any number of rows, so the decode path is a decode team; `none` (float32): the fused layers take at
most 4 rows (fused_decode.py `F32_MAX_ROWS`), so k = 4 runs on the layout's eager decode plan. One thread per rank.
The machine may be shared: every configuration is timed once per round, the rounds interleaved (rotated), and the
figures are medians and ratios of medians. `pcp2-gloo` is PCP=2 with every collective on gloo (no shared-memory
transport, whose waits spin a while before they yield: on an oversubscribed machine a waiting rank holds the core its
peer needs).

    python benchmarks/spec_verify_paths.py [--quantization int4 none] [--rounds 7] [--steps 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))  # the tiny tokenizer

from cpllm import LLM  # noqa: E402
from cpllm.step import ScheduledChunk, SchedulerOutput  # noqa: E402

LAYOUTS = {
    "pcp2": {"prefill_context_parallel_size": 2},
    "pcp2-replicated": {"prefill_context_parallel_size": 2, "cp_kv_cache_layout": "replicated"},
    "tp2-dcp2": {"tensor_parallel_size": 2, "decode_context_parallel_size": 2},
    "pcp2-gloo": {"prefill_context_parallel_size": 2, "collective_transport": "gloo"},
}
BLOCK = 16
PATHS = ("decode", "prefill", "one-token")
"""The verify chunk as decode rows, the same chunk as a prefill chunk, and a plain decode step for scale."""


def build_folder(cache: str) -> str:
    """Save the random model once (reused while it exists)."""
    from tiny_models import save_random_hf_folder, tiny_vocab
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=len(tiny_vocab().tokens), hidden_size=256, intermediate_size=768,
                         num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=1, head_dim=32,
                         max_position_embeddings=4096, rope_theta=10000.0, tie_word_embeddings=True)
    return save_random_hf_folder(config, os.path.join(cache, "llama-l8-h256-mqa"))


class Rig:
    """One launched layout and its requests' contexts; steps go straight to the executor (every rank)."""

    def __init__(self, folder: str, options: dict, quantization: str, context: int, batch: int, k: int):
        self.llm = LLM(folder, quantization=quantization, block_size=BLOCK, max_model_len=4096, threads_per_rank=1,
                       kv_cache_memory_bytes=64 << 20, enable_prefix_caching=False, distributed_timeout=120,
                       **options)
        engine = self.llm.engine
        self.executor, self.context, self.k = engine.executor, context, k
        blocks = -(-(context + k + 1) // engine.tokens_per_block)
        self.tables = [tuple(range(b * blocks, (b + 1) * blocks)) for b in range(batch)]
        self.step_id = 0
        for b, table in enumerate(self.tables):  # each request's context, one prefill chunk each
            prompt = tuple((7 * i + 13 * b) % 250 + 3 for i in range(context))
            self._run((ScheduledChunk(request_id=f"r{b}", token_ids=prompt, start_pos=0, block_table=table,
                                      sample=False, prompt_logits=False),))

    def _run(self, chunks) -> float:
        self.step_id += 1
        begin = time.perf_counter()
        self.executor.execute(SchedulerOutput(step_id=self.step_id, chunks=tuple(chunks)))
        return time.perf_counter() - begin

    def chunks(self, path: str, batch: int) -> list[ScheduledChunk]:
        tokens = tuple(range(40, 41 + self.k)) if path != "one-token" else (40,)
        return [ScheduledChunk(request_id=f"r{b}", token_ids=tokens, start_pos=self.context,
                               block_table=self.tables[b], sample=True, prompt_logits=path == "prefill",
                               num_draft_tokens=self.k if path == "decode" else 0) for b in range(batch)]

    def time(self, path: str, batch: int, steps: int) -> float:
        """Median seconds of `steps` steps."""
        chunks = self.chunks(path, batch)
        return statistics.median(self._run(chunks) for _ in range(steps))

    def plan(self, path: str, batch: int) -> str:
        before = dict(self.executor.rank_stats().plan_counts)
        self._run(self.chunks(path, batch))
        after = self.executor.rank_stats().plan_counts
        return next(name for name, count in after.items() if count != before.get(name, 0))


def measure(folder: str, layout: str, quantization: str, args) -> list[dict]:
    rig = Rig(folder, LAYOUTS[layout], quantization, args.context, max(args.batch_sizes), args.k)
    try:
        configs = [(path, batch) for batch in args.batch_sizes for path in PATHS]
        plans = {c: rig.plan(*c) for c in configs}  # also the warm-up
        times = {c: [] for c in configs}
        for round_index in range(args.rounds):
            order = configs[round_index % len(configs):] + configs[:round_index % len(configs)]  # rotated
            for c in order:
                times[c].append(rig.time(*c, args.steps))
    finally:
        rig.llm.shutdown()
    rows = []
    for batch in args.batch_sizes:
        median = {path: statistics.median(times[(path, batch)]) for path in PATHS}
        rows.append(dict(layout=layout, quantization=quantization, batch=batch, k=args.k, context=args.context,
                         plans={path: plans[(path, batch)] for path in PATHS},
                         median_ms={path: round(1e3 * m, 3) for path, m in median.items()},
                         prefill_over_decode=round(median["prefill"] / median["decode"], 3),
                         decode_over_one_token=round(median["decode"] / median["one-token"], 3),
                         times_s={path: times[(path, batch)] for path in PATHS}))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", default="/tmp/cpllm-spec-verify-bench", help="where the random model is saved")
    parser.add_argument("--layouts", nargs="+", default=["pcp2", "tp2-dcp2"], choices=sorted(LAYOUTS))
    parser.add_argument("--quantization", nargs="+", default=["int4", "none"], choices=("int4", "none"))
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--k", type=int, default=4, help="drafts per request")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5, help="steps per configuration and round (median)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    folder = build_folder(args.cache)
    rows = [row for layout in args.layouts for q in args.quantization for row in measure(folder, layout, q, args)]
    print(f"{'layout':16} {'quant':5} {'B':>2} {'decode plan':>16} {'decode ms':>9} {'prefill ms':>10} "
          f"{'1-token ms':>10} {'prefill/decode':>14} {'decode/1-token':>14}")
    for r in rows:
        m = r["median_ms"]
        print(f"{r['layout']:16} {r['quantization']:5} {r['batch']:>2} {r['plans']['decode']:>16} "
              f"{m['decode']:>9.2f} {m['prefill']:>10.2f} {m['one-token']:>10.2f} {r['prefill_over_decode']:>14.2f} "
              f"{r['decode_over_one_token']:>14.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
