"""Where the new K/V of a pass-Q step is stored: the per-step plan of `pass_q.py`.

Under pass-Q the new tokens' K/V never travel for attention (queries do), but
the KV cache still wants every token on its owner (`KVLayout.owner`), which is
usually another CP rank than the PCP rank that computed it. So each rank:
- stores at once the new tokens it computed and owns (`local_rows`), single
  tokens included (every PCP rank holds those, and they must be in the pool
  before they attend to their own context);
- sends the other rows it computed to their owners, and receives the rows it
  owns from the ranks that computed them; these ride in the same all-to-all that
  returns the partial attention outputs (one collective per layer).

A token computed on PCP rank `h` (all DCP ranks of `h` hold it, with the same
KV heads) and owned by CP rank `(po, do)` is sent by CP rank `(h, do)`. Every
rank builds the same lists in the same order (requests in step order,
positions ascending), so senders and receivers agree without talking.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpllm.context_parallel.kv_layout import KVLayout, owned_slots
from cpllm.distributed.parallel_dims import cp_coords, cp_rank_of


@dataclass(kw_only=True, frozen=True, slots=True)
class PassQPlan:
    """This rank's K/V stores in one pass-Q step."""

    local_rows: torch.Tensor
    """[n_local] rows of this rank's batch whose tokens it owns: stored from its own k, v."""
    local_slots: torch.Tensor
    """[n_local] pool slots of those rows."""
    send_rows: torch.Tensor
    """[n_send] rows of this rank's batch whose K/V go to their owners, grouped by destination CP rank."""
    send_counts: tuple[int, ...]
    """Rows sent to each CP rank (index = cp rank); 0 for this rank itself."""
    recv_slots: torch.Tensor
    """[n_recv] pool slots of the rows received, grouped by source CP rank, in the senders' order."""
    recv_counts: tuple[int, ...]
    """Rows received from each CP rank (index = cp rank)."""


def build_pass_q_plan(chunks, new_kv_rows: list[torch.Tensor | None], local_single_rows: list[int | None],
                      layout: KVLayout, pcp_size: int, pcp_rank: int, num_rows: int) -> PassQPlan:
    """The plan of one step; `new_kv_rows[i]` is chunk i's [num_new] gathered row (pcp rank * num_rows + row)
    of each new token (None for a single token), `local_single_rows[i]` this rank's row of a single token."""
    cp, me = layout.num_shards, layout.shard_rank
    dcp = cp // pcp_size  # the sharded layout's shards are the cp group: PCP x DCP
    _, my_dcp = cp_coords(me, dcp)
    local_rows, local_slots = [], []
    send = [[] for _ in range(cp)]
    recv = [[] for _ in range(cp)]
    for chunk, gathered, single_row in zip(chunks, new_kv_rows, local_single_rows):
        table = torch.tensor(chunk.block_table, dtype=torch.long)
        if gathered is None:  # a single token, held by every PCP rank: its owner stores it itself
            if layout.owner(chunk.start_pos) == me:
                local_rows.append(torch.tensor([single_row]))
                local_slots.append(torch.tensor([layout.slot(chunk.start_pos, chunk.block_table)]))
            continue
        positions = chunk.start_pos + torch.arange(len(chunk.token_ids))  # [T]
        home = torch.div(gathered, num_rows, rounding_mode="floor")  # [T] PCP rank that computed each token
        row = gathered % num_rows
        owner = torch.div(positions, layout.interleave, rounding_mode="floor") % cp  # [T] CP rank storing it
        _, owner_dcp = cp_coords(owner, dcp)
        mine = owner == me
        computed_here = home == pcp_rank
        keep = computed_here & mine
        local_rows.append(row[keep])
        local_slots.append(owned_slots(positions[keep], table, layout))
        # Sent by the DCP rank that matches the owner's: exactly one sender per token.
        outgoing = computed_here & ~mine & (owner_dcp == my_dcp)
        for dest in torch.unique(owner[outgoing]).tolist():
            send[dest].append(row[outgoing & (owner == dest)])
        incoming = mine & ~computed_here
        for source_pcp in torch.unique(home[incoming]).tolist():
            take = incoming & (home == source_pcp)
            recv[cp_rank_of(source_pcp, my_dcp, dcp)].append(owned_slots(positions[take], table, layout))
    return PassQPlan(
        local_rows=_cat(local_rows), local_slots=_cat(local_slots),
        send_rows=_cat([r for rows in send for r in rows]),
        send_counts=tuple(sum(r.numel() for r in rows) for rows in send),
        recv_slots=_cat([s for slots in recv for s in slots]),
        recv_counts=tuple(sum(s.numel() for s in slots) for slots in recv),
    )


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts).long() if parts else torch.zeros(0, dtype=torch.long)
