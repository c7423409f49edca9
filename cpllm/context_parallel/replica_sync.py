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


def sync_replicas(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], sync: ReplicaSync, pcp_group,
                  pcp_rank: int) -> None:
    """Copy each PCP rank's newly written slots into every other PCP rank's pools (one all-gather)."""
    width = max(s.numel() for s in sync.slots)
    if width == 0:
        return
    k0 = kv_caches[0][0]
    mine = sync.slots[pcp_rank]
    # [width, layers, 2, Hkv, D]: this rank's rows first, zero padding after (gloo gathers equal sizes only)
    block = torch.zeros(width, len(kv_caches), 2, *k0.shape[1:], dtype=k0.dtype, device=k0.device)
    for layer, (k_pool, v_pool) in enumerate(kv_caches):
        block[: mine.numel(), layer, 0] = k_pool[mine]
        block[: mine.numel(), layer, 1] = v_pool[mine]
    gathered = all_gather(block, pcp_group).view(len(sync.slots), width, *block.shape[1:])
    for source, slots in enumerate(sync.slots):
        if source == pcp_rank or slots.numel() == 0:
            continue
        rows = gathered[source, : slots.numel()]
        for layer, (k_pool, v_pool) in enumerate(kv_caches):
            k_pool[slots] = rows[:, layer, 0]
            v_pool[slots] = rows[:, layer, 1]
