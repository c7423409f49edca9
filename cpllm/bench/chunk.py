"""Time to first token of a short chunk on top of a cached context, per layout and prefill strategy.

The multi-turn case pass-Q is for: a long context is prefilled once (and stays in the prefix cache), then each
repeat sends the context plus a fresh chunk of new tokens; only the chunk is computed. The strategies each step
ran (the runner's counts) and the prefix-cache hits are recorded with the times, so a row says what `auto` chose.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cpllm.bench.common import BenchLayout, random_prompt
from cpllm.bench.engines import build_llm, model_config_of
from cpllm.bench.prefill import layout_runs, time_prefill


@dataclass(kw_only=True, frozen=True, slots=True)
class ChunkResult:
    """TTFT of one (layout, strategy) over repeats."""

    layout: str
    strategy: str | None
    context_tokens: int
    chunk_tokens: int
    ttft_s: list[float]
    ran: dict[str, int]
    """Prompt steps per strategy over the timed repeats (the driver's count)."""
    hit_tokens: int
    """Prefix-cache hits over the timed repeats (context_tokens per repeat when the context stays cached)."""

    def row(self) -> dict[str, Any]:
        return {"layout": self.layout, "strategy": self.strategy or "-", "context_tokens": self.context_tokens,
                "chunk_tokens": self.chunk_tokens, "ttft_s": round(min(self.ttft_s), 4),
                "ttft_median_s": round(statistics.median(self.ttft_s), 4),
                "ran": ",".join(f"{k}:{v}" for k, v in self.ran.items() if v) or "-",
                "hit_tokens_per_repeat": self.hit_tokens // len(self.ttft_s),
                "ttft_all_s": [round(t, 4) for t in self.ttft_s]}


def run_chunk_bench(model: str | None, *, context: int, chunk: int, layouts: list[BenchLayout], strategies: list[str],
                    threads_per_rank: int | None = None, repeats: int = 3,
                    engine_options: dict[str, Any] | None = None,
                    progress: Callable[[str], None] | None = None) -> list[ChunkResult]:
    config = model_config_of(model)
    base = random_prompt(context, config.vocab_size, seed=11)
    results = []
    for layout, strategy in layout_runs(layouts, strategies):
        llm, threads = build_llm(model, layout, strategy=strategy, threads_per_rank=threads_per_rank,
                                 context_tokens=context + chunk + 64, batch_tokens=max(context, chunk) + 16,
                                 engine_options=engine_options, prefix_caching=True)
        try:
            time_prefill(llm, base)  # the context, computed once and kept by the prefix cache
            executor, scheduler = llm.engine.executor, llm.engine.scheduler
            before, hits_before = executor.rank_stats().strategy_counts, scheduler.num_prefix_hit_tokens
            times = []
            for repeat in range(repeats):
                new = random_prompt(chunk, config.vocab_size, seed=1000 + repeat)
                times.append(time_prefill(llm, base + new))
                if progress:
                    progress(f"{layout.label(threads)} {strategy or ''}")
            after = executor.rank_stats().strategy_counts
            results.append(ChunkResult(layout=layout.label(threads), strategy=strategy, context_tokens=context,
                                       chunk_tokens=chunk, ttft_s=times,
                                       ran={k: after[k] - before[k] for k in after},
                                       hit_tokens=scheduler.num_prefix_hit_tokens - hits_before))
        finally:
            llm.shutdown()
    return results
