"""Per-rank KV pools: the flat [num_slots, heads, width] tensors each layer's cache spec names (a K and a V pool of
this rank's KV heads; one latent pool read as both), each layer's sized by its KV group's block count
(cpllm/kv_groups.py: a sliding-window group needs only its requests' windows, the full-attention layers take the
rest of the memory). Nothing here knows a layer kind: the specs (cpllm/layers/cache_spec.py) say what to allocate."""

from __future__ import annotations

import logging
import math
import mmap
import os

import torch

from cpllm.config.engine import EngineConfig
from cpllm.kv_groups import KVGroupSpec, group_block_needs, group_cache_spec, split_blocks
from cpllm.layers.cache_spec import CacheSpec

logger = logging.getLogger(__name__)

DEFAULT_MEMORY_FRACTION = 0.2
"""Share of this machine's available memory (split among its ranks) used for KV when no size is given."""


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


def layer_cache_spec(config: EngineConfig, num_kv_heads: int, dtype: torch.dtype,
                     group: KVGroupSpec) -> CacheSpec:
    """One layer's cache spec in `group` on a rank holding `num_kv_heads` KV heads, in the pools' dtype."""
    return group_cache_spec(group, config.model, num_kv_heads, torch.empty((), dtype=dtype).element_size())


def layer_bytes_per_block(config: EngineConfig, num_kv_heads: int, dtype: torch.dtype, group: KVGroupSpec) -> int:
    """Cache bytes of one block of one layer on one rank."""
    return layer_cache_spec(config, num_kv_heads, dtype, group).block_bytes(config.cache.block_size)


def group_block_counts(config: EngineConfig, device: torch.device, groups: tuple[KVGroupSpec, ...],
                       layer_block_bytes: int, reserved_bytes: int = 0) -> tuple[int, ...]:
    """This rank's blocks in each KV group's pools. Every group gets what full attention in every layer would
    (the budget over all layers) unless it needs fewer (kv_groups.split_blocks); what a windowed group cannot use
    (max_num_seqs windows plus a step's tokens) goes to the full-attention groups. Without an explicit
    kv_cache_memory_bytes no group gets more than the run can use (a one-prompt `generate` needs megabytes, not a
    fifth of the machine); an explicit budget is taken as asked: its spare blocks keep finished prompts in the
    prefix cache (in the full groups, or, when every layer slides, in the windowed ones). The same on every rank of
    a replica, since the config is; the runner still takes the replica's minimum. `reserved_bytes` (the per-request
    state pools, `state_bytes`) come out of the budget first."""
    s = config.scheduler
    tokens_per_block = config.cache.block_size * config.parallel.dims.kv_shard_size
    needs: tuple[int | None, ...] = group_block_needs(groups, tokens_per_block, s.max_num_seqs, s.max_model_len,
                                                      s.max_num_batched_tokens)
    if config.cache.kv_cache_memory_bytes is not None:
        has_full = any(g.window is None for g in groups)
        needs = tuple(None if g.window is None or not has_full else n for g, n in zip(groups, needs))
    budget = kv_budget_bytes(config, device) - reserved_bytes
    if budget <= 0:
        raise ValueError(f"the KV budget of {budget + reserved_bytes} bytes per rank does not hold the "
                         f"{reserved_bytes} bytes of per-request states (max_num_seqs={s.max_num_seqs}): raise "
                         "kv_cache_memory_bytes or lower max_num_seqs")
    counts = split_blocks(tuple(len(g.layers) for g in groups), needs, layer_block_bytes, budget)
    budget_blocks = budget // (layer_block_bytes * config.model.num_hidden_layers)
    for group, count in zip(groups, counts):
        if count < budget_blocks:
            logger.info("KV cache: %d blocks per rank for the %s: all max_num_seqs=%d sequences (max_model_len=%d, "
                        "max_num_batched_tokens=%d) can hold there, fewer than the budget's %d", count,
                        group.describe(), s.max_num_seqs, s.max_model_len, s.max_num_batched_tokens, budget_blocks)
    return counts


def allocate_kv_cache(layer_blocks: list[int], block_size: int, layer_specs: list[CacheSpec], dtype: torch.dtype,
                      device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    """Each layer's pools as its spec names them: layer i holds `layer_blocks[i]` blocks (its KV group's count) in
    each of `layer_specs[i].pools`, a pool [blocks * block_size, heads, width]. The layer's cache is the tuple of
    its pools; a spec whose one pool is read as K and V (`shared_kv`) gives (pool, pool), the same tensor."""
    caches = []
    for blocks, spec in zip(layer_blocks, layer_specs, strict=True):
        pools = tuple(zeroed_pool((blocks * block_size, pool.heads, pool.width), dtype, device) for pool in spec.pools)
        caches.append(pools * 2 if spec.shared_kv else pools)
    return caches


def state_bytes(specs: list[CacheSpec], num_slots: int) -> int:
    """Bytes of the per-request state pools of `specs` (one per state layer) with `num_slots` slots each."""
    return num_slots * sum(spec.bytes_per_request for spec in specs)


def allocate_states(specs: list[CacheSpec], num_slots: int, device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    """Each state layer's pools, [num_slots, heads, width] per `PoolSpec` of its spec, indexed by state slot, at
    the spec's element size (a float type of that many bytes)."""
    dtypes = {4: torch.float32, 2: torch.bfloat16, 8: torch.float64}
    return [tuple(zeroed_pool((num_slots, pool.heads, pool.width), dtypes[spec.element_bytes], device)
                  for pool in spec.pools) for spec in specs]


def copy_state_slots(caches: list[tuple[torch.Tensor, ...]], layers, pairs: list[tuple[int, int]]) -> None:
    """For each (source, destination) slot pair, every state pool of `layers` (indices into `caches`) gets the
    source slot's state in the destination slot: a prefix hit's snapshot into the request's slot, or a request's
    states into a snapshot slot (cpllm/engine/state_snapshots.py). Kind-free: a state is whatever its pools hold."""
    if not pairs:
        return
    src = torch.tensor([a for a, _ in pairs], dtype=torch.long)
    dst = torch.tensor([b for _, b in pairs], dtype=torch.long)
    for layer in layers:
        for pool in caches[layer]:
            pool.index_copy_(0, dst.to(pool.device), pool.index_select(0, src.to(pool.device)))


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
