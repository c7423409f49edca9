"""Output tokens/s in steady decode, per layout, batch size and context length."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cpllm.bench.common import Layout, random_prompt
from cpllm.bench.engines import build_llm, model_config_of
from cpllm.engine.sampling_params import SamplingParams


@dataclass(kw_only=True, frozen=True, slots=True)
class DecodeResult:
    """Steady-state decode of `batch_size` requests at `context_tokens` of context."""

    system: str
    layout: str
    total_threads: int
    batch_size: int
    context_tokens: int
    steps: int
    """Decode steps timed (each produces one token per request)."""
    seconds: float
    """Wall time of those steps."""

    @property
    def tokens_per_s(self) -> float:
        """Aggregate output tokens/s over the batch."""
        return self.batch_size * self.steps / self.seconds

    @property
    def step_ms(self) -> float:
        return 1000 * self.seconds / self.steps

    def row(self) -> dict[str, Any]:
        return {
            "system": self.system, "layout": self.layout, "threads": self.total_threads,
            "batch_size": self.batch_size, "context_tokens": self.context_tokens,
            "tokens_per_s": round(self.tokens_per_s, 2), "per_request_tokens_per_s":
            round(self.tokens_per_s / self.batch_size, 2), "step_ms": round(self.step_ms, 2),
        }


def time_decode(engine, prompts: list[list[int]], steps: int, tag: str) -> float:
    """Prefill every prompt, then time `steps` decode steps of the whole batch; returns seconds."""
    params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    started = set()
    while len(started) < len(ids):  # prefill (possibly chunked over several steps)
        started.update(o.request_id for o in engine.step() if o.outputs[0].token_ids)
    begin = time.perf_counter()
    for _ in range(steps):
        engine.step()
    seconds = time.perf_counter() - begin
    for request_id in ids:
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    return seconds


def _decode_options(engine_options: dict[str, Any] | None, longest: int, batch: int) -> dict[str, Any]:
    """The caller's options (unset ones dropped), with room for the longest request and the largest batch."""
    options = {k: v for k, v in (engine_options or {}).items() if v is not None}
    options.setdefault("max_model_len", longest)
    options["max_num_seqs"] = max(options.get("max_num_seqs", 1), batch)
    return options


def run_decode_bench(
    model: str | None,
    *,
    batch_sizes: list[int],
    context_lengths: list[int],
    layouts: list[Layout],
    strategy: str = "allgather",
    steps: int = 32,
    threads_per_rank: int | None = None,
    engine_options: dict[str, Any] | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[DecodeResult]:
    """One engine per layout; for each (batch, context): prefill, then time `steps` decode steps."""
    config = model_config_of(model)
    results = []
    longest = max(context_lengths) + steps + 16
    for layout in layouts:
        llm, threads = build_llm(model, layout, strategy=strategy, threads_per_rank=threads_per_rank,
                                 context_tokens=longest * max(batch_sizes), batch_tokens=max(8192, longest),
                                 engine_options=_decode_options(engine_options, longest, max(batch_sizes)))
        try:
            time_decode(llm.engine, [random_prompt(16, config.vocab_size, seed=-1)], 4, "warmup")
            for context in context_lengths:
                for batch in batch_sizes:
                    prompts = [random_prompt(context, config.vocab_size, seed=context * 1000 + i) for i in range(batch)]
                    seconds = time_decode(llm.engine, prompts, steps, f"b{batch}c{context}")
                    results.append(DecodeResult(system="cpllm", layout=layout.label(threads),
                                                total_threads=threads * layout.world_size, batch_size=batch,
                                                context_tokens=context, steps=steps, seconds=seconds))
                    if progress:
                        progress(f"{layout.label(threads)} batch {batch} context {context}")
        finally:
            llm.shutdown()
    return results
