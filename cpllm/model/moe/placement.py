"""Where a MoE layer's experts live: the MoE group (flattened TP x PCP ranks of a replica) and this rank's share.

The group rank is `m = pcp_rank * TP + tp_rank` (the replica's rank order: `ParallelDims.moe_rank`), M = TP x PCP.
- expert-TP (default): rank m holds rows [m*I/M, (m+1)*I/M) of every expert's gate and up projections and the
  same columns of its down projection; each rank's partial outputs sum to the expert's output.
- expert parallel: rank m holds experts [m*E/M, (m+1)*E/M) whole; a token's partials come from the ranks
  holding its experts.
Either way the sum over the group of every rank's partial is the layer's output, so the collectives are the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from cpllm.model.layers import TPShard


@dataclass(kw_only=True, frozen=True, slots=True)
class MoEShard:
    """This rank's place in the MoE group and the groups its collectives use."""

    tp: TPShard
    """The TP group (sums the partials of the TP ranks that hold the same tokens)."""
    pcp_rank: int = 0
    """Rank inside the PCP group."""
    pcp_size: int = 1
    """PCP ranks; under PCP each holds different prefill tokens."""
    pcp_group: dist.ProcessGroup | None = None
    """The PCP group (tokens gathered over it, partial sums scattered back over it); None when alone."""
    group: dist.ProcessGroup | None = None
    """The flattened TP x PCP group (one all-reduce when every PCP rank holds the same rows); None when alone."""
    expert_parallel: bool = False
    """Whole experts per rank (True) or every expert's rows split (False, expert-TP)."""

    @property
    def rank(self) -> int:
        """Rank in the MoE group: pcp_rank * TP + tp_rank."""
        return self.pcp_rank * self.tp.size + self.tp.rank

    @property
    def size(self) -> int:
        return self.pcp_size * self.tp.size


@dataclass(kw_only=True, frozen=True, slots=True)
class ExpertSlice:
    """The experts, and the rows of each, that one rank holds."""

    first_expert: int
    """First expert held."""
    num_experts: int
    """Experts held (consecutive)."""
    row_start: int
    """First intermediate row held of each of them."""
    row_end: int
    """One past the last intermediate row held."""

    @property
    def rows(self) -> int:
        return self.row_end - self.row_start


def expert_slice(num_experts: int, intermediate: int, shard: MoEShard) -> ExpertSlice:
    """This rank's experts and rows (the sizes were checked at config time: cpllm/config/moe.py)."""
    m, size = shard.rank, shard.size
    if shard.expert_parallel:
        per_rank = num_experts // size
        return ExpertSlice(first_expert=m * per_rank, num_experts=per_rank, row_start=0, row_end=intermediate)
    rows = intermediate // size
    return ExpertSlice(first_expert=0, num_experts=num_experts, row_start=m * rows, row_end=(m + 1) * rows)
