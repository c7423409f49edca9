"""Pieces every bench command shares: layouts, prompts, engine options, the machine description."""

from __future__ import annotations

import os
import platform
import random
from dataclasses import dataclass
from typing import Any

from cpllm.distributed.parallel_dims import ParallelDims
from cpllm.kv_groups import full_cache_spec


@dataclass(kw_only=True, frozen=True, slots=True)
class BenchLayout:
    """One measured layout: the engine's parallel dims and each rank's threads, written TPxPCPxDCP[@threads]."""

    dims: ParallelDims
    """The parallel sizes (one replica)."""
    threads_per_rank: int | None = None
    """torch threads in each rank's process; None = the bench's --threads-per-rank (or cores / ranks)."""

    @classmethod
    def of(cls, *, tp: int = 1, pcp: int = 1, dcp: int = 1, threads_per_rank: int | None = None) -> "BenchLayout":
        return cls(dims=ParallelDims(tp=tp, pcp=pcp, dcp=dcp), threads_per_rank=threads_per_rank)

    def label(self, threads: int | None = None) -> str:
        """The dims' label, with '@threads' when the threads per rank are known."""
        threads = threads if threads is not None else self.threads_per_rank
        return self.dims.label() if threads is None else f"{self.dims.label()}@{threads}"


def parse_layout(text: str) -> BenchLayout:
    """'1x2x1' or '1x1x1@2' (two threads per rank) -> BenchLayout."""
    spec, _, threads = text.strip().partition("@")
    parts = spec.lower().split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"layout {text!r} is not TPxPCPxDCP with positive sizes (example: 1x2x1 or 1x1x1@2)")
    if threads and (not threads.isdigit() or int(threads) < 1):
        raise ValueError(f"layout {text!r}: threads after '@' must be a positive integer")
    tp, pcp, dcp = (int(p) for p in parts)
    try:
        return BenchLayout.of(tp=tp, pcp=pcp, dcp=dcp, threads_per_rank=int(threads) if threads else None)
    except ValueError as error:  # a size rule of the engine, refused before any engine starts
        raise ValueError(f"layout {text!r}: {error}") from None


def parse_int_list(text: str, name: str) -> list[int]:
    """'1024,2048' -> [1024, 2048]; every value must be a positive integer."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{name}: {text!r} is not a comma-separated list of integers") from None
    if not values or any(v < 1 for v in values):
        raise ValueError(f"{name}: {text!r} must list positive integers")
    return values


def parse_str_list(text: str, name: str, allowed: tuple[str, ...]) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in values if v not in allowed]
    if not values or bad:
        raise ValueError(f"{name}: {text!r} must be a comma-separated subset of {allowed}")
    return values


def threads_for(layout: BenchLayout, default: int | None) -> int:
    """Threads per rank: the layout's, else the bench-wide option, else the cores shared out evenly.

    Always explicit: with more busy threads than cores, OpenMP spin-waiting makes small ops very slow.
    """
    if layout.threads_per_rank is not None:
        return layout.threads_per_rank
    if default is not None:
        return default
    return max(1, (os.cpu_count() or 1) // layout.dims.world_size)


def random_prompt(length: int, vocab_size: int, seed: int) -> list[int]:
    """Reproducible token ids, avoiding the first ids (special tokens in most vocabularies)."""
    rng = random.Random(seed)
    low = min(16, vocab_size - 1)
    return [rng.randrange(low, vocab_size) for _ in range(length)]


def kv_bytes_per_token(model_config: Any, dtype_bytes: int = 4) -> int:
    """Cache bytes of one token over all layers on a single rank (no sharding), from the layers' cache spec."""
    spec = full_cache_spec(model_config, model_config.num_key_value_heads, dtype_bytes)
    return model_config.num_hidden_layers * spec.bytes_per_token


def kv_budget_for(model_config: Any, tokens: int, cp_size: int, dtype_bytes: int = 4) -> int:
    """Per-rank KV bytes that hold `tokens` of context (plus blocks of slack), instead of a fraction of RAM."""
    per_rank_tokens = -(-tokens // cp_size) + 256
    return per_rank_tokens * kv_bytes_per_token(model_config, dtype_bytes)


def machine_info() -> dict[str, Any]:
    """What a reader needs to compare numbers: CPU, cores, load, library versions."""
    import torch

    info: dict[str, Any] = {
        "cpu": _cpu_name(),
        "cpu_family_model": _cpu_family_model(),
        "cores": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
    }
    for package in ("transformers", "llama_cpp"):
        try:
            module = __import__(package)
            info[package] = getattr(module, "__version__", "?")
        except ImportError:
            info[package] = None
    return info


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _cpu_family_model() -> str | None:
    """"family F model M" from /proc/cpuinfo: a virtual machine's model name may say only the vendor's line ("AMD
    EPYC"), while two generations of it differ 2x in bf16 matmul rate."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("cpu family", "model") and key.strip() not in fields:
                    fields[key.strip()] = value.strip()
                if not line.strip():
                    break  # the first processor's block is enough
    except OSError:
        return None
    if len(fields) < 2:
        return None
    return f"family {fields['cpu family']} model {fields['model']}"
