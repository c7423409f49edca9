"""Build one cpllm engine per measured layout, with the bench's overrides applied."""

from __future__ import annotations

from typing import Any

from cpllm.bench.common import BenchLayout, kv_budget_for, threads_for
from cpllm.engine.llm import LLM
from cpllm.engine_options import resolve_options
from cpllm.model.loaders.default_model import default_model_path
from cpllm.model.loaders.loader import open_weights

BENCH_SETS = ("tensor_parallel_size", "prefill_context_parallel_size", "decode_context_parallel_size",
              "cp_prefill_strategy", "enable_prefix_caching")
"""The engine options every bench engine sets itself (its layout, its strategy, prefix caching off); besides these
it sets kv_cache_memory_bytes, max_model_len and max_num_batched_tokens to the run's context and step budget where
the caller left them None. Every other option is the caller's or the option table's default
(cpllm/engine_options.py), so the Python API and the `cpllm bench` flags run the same engine."""


def model_config_of(model: str | None):
    return open_weights(model or default_model_path()).config


BENCH_STATE_SLOTS = 4
"""max_num_seqs of a benchmark engine of a hybrid model (its per-request states take room the K/V budget
`kv_budget_for` gives does not count)."""


def build_llm(
    model: str | None,
    layout: BenchLayout,
    *,
    strategy: str | None,
    threads_per_rank: int | None,
    context_tokens: int,
    batch_tokens: int,
    engine_options: dict[str, Any] | None = None,
    prefix_caching: bool = False,
) -> tuple[LLM, int]:
    """An LLM for `layout` whose KV cache holds `context_tokens` and whose step budget is `batch_tokens`.

    Prefix caching is off unless asked for: repeated runs must compute every token, not hit the cache.
    Returns the LLM and the threads per rank it runs with.
    """
    given = {key: value for key, value in (engine_options or {}).items() if key != "model"}
    options = resolve_options(given, "build_llm")  # an unknown option is refused by name
    options.pop("threads_per_rank")
    threads = threads_for(layout, threads_per_rank)
    config = model_config_of(model)
    if options.get("kv_cache_memory_bytes") is None:
        options["kv_cache_memory_bytes"] = kv_budget_for(config, context_tokens, layout.dims.kv_shard_size)
    if "max_num_seqs" not in given and getattr(config, "linear_attention", None) is not None:
        # a hybrid's states are sized per sequence slot, beside that budget: a benchmark runs a few requests
        options["max_num_seqs"] = BENCH_STATE_SLOTS
    if options.get("max_model_len") is None:
        options["max_model_len"] = min(context_tokens, config.max_position_embeddings)
    if options.get("max_num_batched_tokens") is None:
        options["max_num_batched_tokens"] = batch_tokens
    options.update(
        tensor_parallel_size=layout.dims.tp,
        prefill_context_parallel_size=layout.dims.pcp,
        decode_context_parallel_size=layout.dims.dcp,
        cp_prefill_strategy=strategy or "allgather",
        enable_prefix_caching=prefix_caching,
    )
    return LLM(model, threads_per_rank=threads, **options), threads
