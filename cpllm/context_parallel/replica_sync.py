"""Replicated KV layout: keep every PCP rank's copy of the cache whole when PCP ranks split the decode batch.

Under `--cp-kv-cache-layout replicated` each PCP rank stores every token (sharded over DCP only), so a decode
token attends to its whole context on one rank, with no PCP collective in the layers. The PCP ranks then share
the decode batch: each single-token chunk runs on one of them (metadata.py), which stores its K/V. In steps with
a prompt chunk those K/V travel anyway, with the prompt's (all-gather or ring), and every rank stores them. In a
decode-only step nothing travels, so after the forward one all-gather over the PCP group (all layers at once)
brings each rank the K/V the others computed, at the same pool slots: the slot of a token depends only on the
block table and the DCP layout, which all PCP ranks share. Which steps sync is the step plan's
(`StepPlan.replica_sync`, plan.py): the runner runs `sync_replicas` exactly after those.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpllm.context_parallel.kv_layout import KVLayout
from cpllm.distributed.comm import all_gather


@dataclass(kw_only=True, frozen=True, slots=True)
class ReplicaSync:
    """Pool slots each PCP rank wrote in this step, among those this (DCP) rank stores."""

    slots: tuple[torch.Tensor, ...]
    """Index = PCP rank: [n_p] slots whose K/V that rank computed; the same slots on every PCP rank."""


def build_replica_sync(chunks, runs_per_chunk, layout: KVLayout, pcp_size: int) -> ReplicaSync:
    """`runs_per_chunk[i][p]` are chunk i's runs on PCP rank p (single tokens: exactly one rank holds each)."""
    slots: list[list[int]] = [[] for _ in range(pcp_size)]
    for chunk, runs in zip(chunks, runs_per_chunk):
        home = next(p for p in range(pcp_size) if runs[p])
        for pos in layout.owned_positions(chunk.start_pos, chunk.end_pos):
            slots[home].append(layout.slot(pos, chunk.block_table))
    return ReplicaSync(slots=tuple(torch.tensor(s, dtype=torch.long) for s in slots))


def sync_replicas(kv_caches: list[tuple[torch.Tensor, ...]], sync: ReplicaSync, pcp_group, pcp_rank: int) -> None:
    """Copy each PCP rank's newly written slots into every other PCP rank's pools (one all-gather). A layer's
    cache is the tuple of its pools, each [slots, heads, width] of any heads and width (K and V; a latent pool
    read as both; a latent pool and an index pool): a slot's row of every pool travels, flattened side by side."""
    width = max(s.numel() for s in sync.slots)
    if width == 0:
        return
    pools = [pool for cache in kv_caches for pool in cache]
    values = [pool[0].numel() for pool in pools]  # per slot
    mine = sync.slots[pcp_rank]
    # [width, values of every pool]: this rank's rows first, zero padding after (gloo gathers equal sizes only)
    block = torch.zeros(width, sum(values), dtype=pools[0].dtype, device=pools[0].device)
    if mine.numel():
        block[: mine.numel()] = torch.cat([pool[mine].reshape(mine.numel(), -1) for pool in pools], dim=1)
    gathered = all_gather(block, pcp_group).view(len(sync.slots), width, -1)
    for source, slots in enumerate(sync.slots):
        if source == pcp_rank or slots.numel() == 0:
            continue
        rows = gathered[source, : slots.numel()].split(values, dim=1)
        for pool, row in zip(pools, rows):
            pool[slots] = row.view(slots.numel(), *pool.shape[1:])
