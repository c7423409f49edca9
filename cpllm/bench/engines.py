"""Build one cpllm engine per measured layout, with the bench's overrides applied."""

from __future__ import annotations

from typing import Any

from cpllm.bench.common import BenchLayout, kv_budget_for, threads_for
from cpllm.engine.llm import LLM
from cpllm.model.default_model import default_model_path
from cpllm.model.loader import open_weights

DEFAULTS: dict[str, Any] = dict(
    dtype="float32", block_size=16, max_num_seqs=64, seed=0, data_parallel_size=1,
    cp_kv_cache_interleave_size=1, distributed_timeout=600.0,
)
"""Engine options when the caller passes none (the Python API); the CLI passes engine_kwargs(args)."""


def model_config_of(model: str | None):
    return open_weights(model or default_model_path()).config


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
    options = {**DEFAULTS, **(engine_options or {})}
    for key in ("model", "threads_per_rank"):
        options.pop(key, None)
    threads = threads_for(layout, threads_per_rank)
    config = model_config_of(model)
    if options.get("kv_cache_memory_bytes") is None:
        options["kv_cache_memory_bytes"] = kv_budget_for(config, context_tokens, layout.dims.kv_shard_size)
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
