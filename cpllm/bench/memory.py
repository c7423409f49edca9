"""KV bytes per rank and the longest prompt accepted at a fixed per-rank KV budget, per CP size."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cpllm.bench.common import BenchLayout, kv_bytes_per_token
from cpllm.bench.engines import build_llm, model_config_of
from cpllm.engine.sampling_params import SamplingParams


@dataclass(kw_only=True, frozen=True, slots=True)
class MemoryResult:
    """What one CP size holds with `budget_bytes` of KV cache on each rank."""

    cp_size: int
    budget_bytes: int
    kv_bytes_per_rank: int
    """Bytes the rank-0 KV pools actually allocated."""
    capacity_tokens: int
    """Tokens of context the CP group's KV cache holds."""
    longest_prompt: int
    """Longest prompt the engine accepts (with max_tokens=1), checked by submitting it and one more."""
    formula_capacity_tokens: int
    """budget // (KV bytes of a token / cp_size), rounded down to whole blocks."""

    def row(self) -> dict[str, Any]:
        return {"cp_size": self.cp_size, "budget_mib": round(self.budget_bytes / 2**20, 1),
                "kv_mib_per_rank": round(self.kv_bytes_per_rank / 2**20, 2),
                "capacity_tokens": self.capacity_tokens, "longest_prompt": self.longest_prompt,
                "formula_capacity_tokens": self.formula_capacity_tokens}


def longest_accepted_prompt(engine) -> int:
    """Largest L for which a prompt of L tokens with max_tokens=1 passes the engine's admission check."""
    params = SamplingParams(max_tokens=1)
    low, high = 1, engine.max_model_len + 1  # accepted(low); find the first rejected length
    while high - low > 1:
        mid = (low + high) // 2
        try:
            engine.check_prompt([16] * mid, params)
            low = mid
        except ValueError:
            high = mid
    return low


def run_memory_bench(
    model: str | None,
    *,
    cp_sizes: list[int],
    budget_bytes: int,
    threads_per_rank: int | None = 1,
    block_size: int = 16,
    progress: Callable[[str], None] | None = None,
) -> list[MemoryResult]:
    """One PCP = cp engine per size (no prompt is run: admission is what is measured)."""
    config = model_config_of(model)
    per_token = kv_bytes_per_token(config)
    results = []
    for cp in cp_sizes:
        options = {"kv_cache_memory_bytes": budget_bytes, "max_model_len": config.max_position_embeddings,
                   "block_size": block_size}
        llm, _ = build_llm(model, BenchLayout.of(tp=1, pcp=cp, dcp=1), strategy="allgather",
                           threads_per_rank=threads_per_rank, context_tokens=0, batch_tokens=2048,
                           engine_options=options)
        try:
            engine = llm.engine
            blocks = budget_bytes // (per_token * block_size)
            results.append(MemoryResult(
                cp_size=cp, budget_bytes=budget_bytes, kv_bytes_per_rank=engine.executor.rank_info.kv.bytes,
                capacity_tokens=engine.kv_capacity_tokens, longest_prompt=longest_accepted_prompt(engine),
                formula_capacity_tokens=blocks * block_size * cp))
        finally:
            llm.shutdown()
        if progress:
            progress(f"cp_size {cp}")
    return results
