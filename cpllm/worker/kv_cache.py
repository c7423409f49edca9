"""Per-rank KV pools: one flat [num_slots, kv_heads, head_dim] K and V tensor per layer."""

from __future__ import annotations

import logging
import math
import mmap
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


def usable_blocks(config: EngineConfig) -> int:
    """Blocks per rank the scheduler can ever hold at once: max_num_seqs sequences of max_model_len tokens, each
    over the kv_shard_size ranks one request's KV is divided over (a pool larger than this is never filled)."""
    tokens_per_block = config.cache.block_size * config.parallel.dims.kv_shard_size
    s = config.scheduler
    return s.max_num_seqs * -(-s.max_model_len // tokens_per_block)


def kv_block_count(config: EngineConfig, device: torch.device, per_block: int) -> int:
    """This rank's blocks: what the budget holds, but no more than the run can use when no size was given (a
    one-prompt `generate` needs megabytes, not a fifth of the machine). An explicit kv_cache_memory_bytes is
    taken as asked: its spare blocks keep finished prompts in the prefix cache. The same on every rank of a
    replica, since the config is; the runner still takes the replica's minimum."""
    budget_blocks = kv_budget_bytes(config, device) // per_block
    if config.cache.kv_cache_memory_bytes is not None:
        return budget_blocks
    usable = usable_blocks(config)
    if usable < budget_blocks:
        logger.info("KV cache: %d blocks per rank are all max_num_seqs=%d sequences of max_model_len=%d tokens "
                    "can hold, fewer than the budget's %d", usable, config.scheduler.max_num_seqs,
                    config.scheduler.max_model_len, budget_blocks)
    return min(budget_blocks, usable)


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                      dtype: torch.dtype, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    slots = num_blocks * block_size
    return [
        (zeroed_pool((slots, num_kv_heads, head_dim), dtype, device),
         zeroed_pool((slots, num_kv_heads, head_dim), dtype, device))
        for _ in range(num_layers)
    ]


def zeroed_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor whose zeros cost nothing up front.

    Zeros, not torch.empty garbage: the SDPA paths mask with additive -inf (cpllm/context_parallel/sdpa.py), and
    NaN + -inf is NaN, as is a zero softmax weight times a NaN value; so a gather that reaches a slot no token wrote
    (padding of a batch, the tail of a block) would be safe only if the slot is finite. Keeping zeros makes that
    hold on every path (C decode, SDPA gathers, compiled decode, shared keys, replicated sync) without relying on
    an audit of each.
    On the CPU, torch.zeros writes every page at start (seconds for gigabytes); an anonymous mapping is zero by
    the kernel's promise and its pages appear on first touch, so only the blocks a run uses are ever paid for.
    """
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)  # one device memset, fast
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=torch.uint8).view(dtype).view(shape)  # the tensor keeps `pages` alive
