"""Time to first token vs prompt length, per layout and prefill strategy."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cpllm.bench.ceiling import prefill_flops
from cpllm.bench.common import BenchLayout, random_prompt
from cpllm.bench.engines import build_llm, model_config_of
from cpllm.engine.sampling_params import SamplingParams

WARMUP_TOKENS = 64


@dataclass(kw_only=True, frozen=True, slots=True)
class PrefillResult:
    """TTFT of one (layout, strategy, prompt length), over repeats."""

    system: str
    """"cpllm" here; the comparison scripts add "transformers" and "llama.cpp"."""
    layout: str
    """TPxPCPxDCP@threads_per_rank."""
    strategy: str | None
    """PCP prefill strategy; None when PCP = 1."""
    total_threads: int
    """Threads over all ranks (what the machine's cores are shared by)."""
    prompt_tokens: int
    ttft_s: list[float]
    """Time to first token of each repeat (arrival to first token)."""
    flops: float
    """FLOPs of this prefill (ceiling.prefill_flops, logits for the last row only)."""

    @property
    def ttft_best_s(self) -> float:
        """The fastest repeat: on a shared machine other load only ever adds time."""
        return min(self.ttft_s)

    @property
    def tokens_per_s(self) -> float:
        return self.prompt_tokens / self.ttft_best_s

    @property
    def gflops(self) -> float:
        return self.flops / self.ttft_best_s / 1e9

    def row(self) -> dict[str, Any]:
        return {
            "system": self.system, "layout": self.layout, "strategy": self.strategy or "-",
            "threads": self.total_threads, "prompt_tokens": self.prompt_tokens,
            "ttft_s": round(self.ttft_best_s, 4), "ttft_median_s": round(statistics.median(self.ttft_s), 4),
            "tokens_per_s": round(self.tokens_per_s, 1), "gflops": round(self.gflops, 1),
            "ttft_all_s": [round(t, 4) for t in self.ttft_s],
        }


def layout_runs(layouts: list[BenchLayout], strategies: list[str]) -> list[tuple[BenchLayout, str | None]]:
    """Every (layout, strategy) pair to measure; a layout without PCP runs once (strategy unused)."""
    runs: list[tuple[BenchLayout, str | None]] = []
    for layout in layouts:
        if layout.dims.pcp == 1:
            runs.append((layout, None))
        else:
            runs.extend((layout, strategy) for strategy in strategies)
    return runs


def time_prefill(llm, prompt: list[int]) -> float:
    """Seconds from arrival to first token of one request (max_tokens=1: the prefill alone)."""
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": prompt}, params)[0]
    return out.metrics.first_token_time - out.metrics.arrival_time


def run_prefill_bench(
    model: str | None,
    *,
    lengths: list[int],
    layouts: list[BenchLayout],
    strategies: list[str],
    threads_per_rank: int | None = None,
    repeats: int = 1,
    engine_options: dict[str, Any] | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[PrefillResult]:
    """Measure every (layout, strategy) x length; repeats loop outermost so load drifts hit every layout alike.

    Each engine is built once per repeat, warmed up on a short prompt, then runs each length once
    with a fresh random prompt (so nothing is cached).
    """
    config = model_config_of(model)
    runs = layout_runs(layouts, strategies)
    times: dict[tuple[int, int], list[float]] = {}
    threads_of: dict[int, int] = {}
    for repeat in range(repeats):
        for index, (layout, strategy) in enumerate(runs):
            llm, threads = build_llm(model, layout, strategy=strategy, threads_per_rank=threads_per_rank,
                                     context_tokens=max(lengths) + 16, batch_tokens=max(lengths) + 16,
                                     engine_options=engine_options)
            threads_of[index] = threads
            try:
                time_prefill(llm, random_prompt(min(WARMUP_TOKENS, max(lengths)), config.vocab_size, seed=-1))
                for length in lengths:
                    prompt = random_prompt(length, config.vocab_size, seed=repeat * 1_000_003 + length)
                    times.setdefault((index, length), []).append(time_prefill(llm, prompt))
                    if progress:
                        progress(f"{layout.label(threads)} {strategy or ''} {length} tokens")
            finally:
                llm.shutdown()
    return [
        PrefillResult(system="cpllm", layout=layout.label(threads_of[i]), strategy=strategy,
                      total_threads=threads_of[i] * layout.dims.world_size, prompt_tokens=length,
                      ttft_s=times[(i, length)], flops=prefill_flops(config, length).total)
        for i, (layout, strategy) in enumerate(runs)
        for length in lengths
    ]


def parallel_efficiency(results: list[PrefillResult]) -> list[dict[str, Any]]:
    """TTFT(single rank) / (ranks * TTFT(layout)) against the single-rank run with the same threads per rank.

    Also the speed-up over the single-rank run that uses the same TOTAL threads, when there is one.
    """
    def key(r: PrefillResult) -> tuple[str, int]:
        return r.layout, r.prompt_tokens

    singles = {key(r): r for r in results if r.layout.startswith("1x1x1") and r.system == "cpllm"}
    rows = []
    for r in results:
        if r.system != "cpllm" or r.layout.startswith("1x1x1"):
            continue
        dims, _, threads = r.layout.partition("@")
        tp, pcp, _dcp = (int(x) for x in dims.split("x"))
        ranks = tp * pcp
        same_rank_threads = singles.get((f"1x1x1@{threads}", r.prompt_tokens))
        same_total = singles.get((f"1x1x1@{r.total_threads}", r.prompt_tokens))
        rows.append({
            "layout": r.layout, "strategy": r.strategy or "-", "prompt_tokens": r.prompt_tokens,
            "ttft_s": round(r.ttft_best_s, 4),
            "efficiency": None if same_rank_threads is None
            else round(same_rank_threads.ttft_best_s / (ranks * r.ttft_best_s), 3),
            "speedup_vs_same_total_threads": None if same_total is None
            else round(same_total.ttft_best_s / r.ttft_best_s, 3),
        })
    return rows
