"""Per-rank KV pools: one flat [num_slots, kv_heads, head_dim] K and V tensor per layer."""

from __future__ import annotations

import logging
import os

import torch

from cpllm.config import EngineConfig

logger = logging.getLogger(__name__)

DEFAULT_MEMORY_FRACTION = 0.2
"""Share of this machine's available memory (split among its ranks) used for KV when no size is given."""


def bytes_per_block(config: EngineConfig, num_kv_heads: int, dtype: torch.dtype) -> int:
    """KV bytes of one block on one rank, all layers."""
    m = config.model
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * m.num_hidden_layers * config.cache.block_size * num_kv_heads * m.head_dim * element


def available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo; pass kv_cache_memory_bytes")


def kv_budget_bytes(config: EngineConfig, device: torch.device) -> int:
    if config.cache.kv_cache_memory_bytes is not None:
        return config.cache.kv_cache_memory_bytes
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", config.parallel.dims.world_size))
    if device.type == "cuda":
        local_ranks = 1  # one process per GPU
    budget = int(available_memory_bytes(device) * DEFAULT_MEMORY_FRACTION / local_ranks)
    logger.info("kv_cache_memory_bytes not set: using %.1f MiB per rank (%.0f%% of available memory / %d local ranks)",
                budget / 2**20, DEFAULT_MEMORY_FRACTION * 100, local_ranks)
    return budget


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                      dtype: torch.dtype, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    slots = num_blocks * block_size
    return [
        (torch.zeros(slots, num_kv_heads, head_dim, dtype=dtype, device=device),
         torch.zeros(slots, num_kv_heads, head_dim, dtype=dtype, device=device))
        for _ in range(num_layers)
    ]
