"""Output tokens/s in steady decode, per layout, batch size and context length."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cpllm.bench.common import BenchLayout, random_prompt
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
    round_index: int = 0
    """Which round of the run measured it (every round runs every layout once, in rotated order)."""

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
            "batch_size": self.batch_size, "context_tokens": self.context_tokens, "round": self.round_index,
            "tokens_per_s": round(self.tokens_per_s, 2), "per_request_tokens_per_s":
            round(self.tokens_per_s / self.batch_size, 2), "step_ms": round(self.step_ms, 2),
        }


def _prefill_all(engine, ids: list[str], prompts: list[list[int]], params: SamplingParams) -> None:
    """Add the requests and step until each has its first token (the prefill may take several steps)."""
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    started: set[str] = set()
    while len(started) < len(ids):
        started.update(o.request_id for o in engine.step() if o.outputs[0].token_ids)


def time_decode(engine, prompts: list[list[int]], steps: int, tag: str) -> float:
    """Prefill every prompt, then time `steps` decode steps of the whole batch; returns seconds.

    The first prompt is prefilled alone first, so that with prefix caching on, prompts sharing its
    prefix reuse its KV blocks instead of computing them again.
    """
    # max_tokens leaves room for the decode steps the first request runs while the others prefill
    params = SamplingParams(temperature=0, max_tokens=steps + 64, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    _prefill_all(engine, ids[:1], prompts[:1], params)
    _prefill_all(engine, ids[1:], prompts[1:], params)
    begin = time.perf_counter()
    for _ in range(steps):
        engine.step()
    seconds = time.perf_counter() - begin
    for request_id in ids:
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    return seconds


def _batch_prompts(vocab_size: int, context: int, batch: int, shared_prefix: bool) -> list[list[int]]:
    if not shared_prefix:
        return [random_prompt(context, vocab_size, seed=context * 1000 + i) for i in range(batch)]
    prefix = random_prompt(context - 1, vocab_size, seed=context)
    return [prefix + random_prompt(1, vocab_size, seed=context * 1000 + i) for i in range(batch)]


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
    layouts: list[BenchLayout],
    strategy: str = "allgather",
    steps: int = 32,
    threads_per_rank: int | None = None,
    engine_options: dict[str, Any] | None = None,
    shared_prefix: bool = False,
    rounds: int = 1,
    progress: Callable[[str], None] | None = None,
) -> list[DecodeResult]:
    """One engine per layout and round; for each (batch, context): prefill, then time `steps` decode steps.

    With `rounds` > 1 every layout runs once per round, the layouts' order rotating from round to round, so
    that layouts compared with each other are measured close together in time and none always runs first
    (this machine's speed drifts between minutes; compare layouts within a round).

    With `shared_prefix`, the prompts of a batch differ only in their last token and prefix caching
    is on, so a batch of long contexts costs one long prefill instead of `batch` of them (the decode
    steps still attend over every request's whole context, through shared blocks).
    """
    config = model_config_of(model)
    results = []
    longest = max(context_lengths) + steps + 80  # room for max_tokens = steps + 64
    for round_index in range(rounds):
        shift = round_index % len(layouts)
        for layout in layouts[shift:] + layouts[:shift]:
            results += _decode_layout(model, config.vocab_size, layout, round_index, batch_sizes=batch_sizes,
                                      context_lengths=context_lengths, longest=longest, strategy=strategy,
                                      steps=steps, threads_per_rank=threads_per_rank,
                                      engine_options=engine_options, shared_prefix=shared_prefix,
                                      progress=progress)
    return results


def _decode_layout(model: str | None, vocab_size: int, layout: BenchLayout, round_index: int, *, batch_sizes: list[int],
                   context_lengths: list[int], longest: int, strategy: str, steps: int,
                   threads_per_rank: int | None, engine_options: dict[str, Any] | None, shared_prefix: bool,
                   progress: Callable[[str], None] | None) -> list[DecodeResult]:
    """One engine of `layout`: every (context, batch) point, timed."""
    llm, threads = build_llm(model, layout, strategy=strategy, threads_per_rank=threads_per_rank,
                             context_tokens=longest * max(batch_sizes), batch_tokens=max(8192, longest),
                             engine_options=_decode_options(engine_options, longest, max(batch_sizes)),
                             prefix_caching=shared_prefix)
    results = []
    try:
        time_decode(llm.engine, [random_prompt(16, vocab_size, seed=-1)], 4, "warmup")
        for context in context_lengths:
            for batch in batch_sizes:
                prompts = _batch_prompts(vocab_size, context, batch, shared_prefix)
                seconds = time_decode(llm.engine, prompts, steps, f"b{batch}c{context}")
                results.append(DecodeResult(system="cpllm", layout=layout.label(threads),
                                            total_threads=threads * layout.dims.world_size, batch_size=batch,
                                            context_tokens=context, steps=steps, seconds=seconds,
                                            round_index=round_index))
                if progress:
                    progress(f"{layout.label(threads)} batch {batch} context {context}")
    finally:
        llm.shutdown()
    return results
