"""Where a MoE layer's experts live: the MoE group (flattened TP x PCP ranks of a replica) and this rank's share.

The group rank is `m = pcp_rank * TP + tp_rank` (the replica's rank order: `ParallelDims.moe_rank`, read from the
rank's `ParallelContext` as `rank("moe")`), M = TP x PCP.
- expert-TP (default): rank m holds rows [m*I/M, (m+1)*I/M) of every expert's gate and up projections and the
  same columns of its down projection; each rank's partial outputs sum to the expert's output.
- expert parallel: rank m holds experts [m*E/M, (m+1)*E/M) whole; a token's partials come from the ranks
  holding its experts.
Either way the sum over the group of every rank's partial is the layer's output, so the collectives are the same.
"""

from __future__ import annotations

from dataclasses import dataclass

from cpllm.distributed.parallel_context import ParallelContext


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


def expert_slice(num_experts: int, intermediate: int, parallel: ParallelContext) -> ExpertSlice:
    """This rank's experts and rows (the sizes were checked at config time: cpllm/config/moe.py)."""
    m, size = parallel.rank("moe"), parallel.size("moe")
    if parallel.dims.expert_parallel:
        per_rank = num_experts // size
        return ExpertSlice(first_expert=m * per_rank, num_experts=per_rank, row_start=0, row_end=intermediate)
    rows = intermediate // size
    return ExpertSlice(first_expert=0, num_experts=num_experts, row_start=m * rows, row_end=(m + 1) * rows)
