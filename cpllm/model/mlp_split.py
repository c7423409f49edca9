"""A dense MLP's decode steps split over the PCP ranks (sharded KV layout).

In a decode-only step of the sharded layout every PCP rank holds the same tokens at the same rows
(`AttentionMetadata.rows_same_over_pcp`), and with the MLP weights replicated over PCP each rank would compute
the same MLP. Decode is bound by streaming weights, so instead PCP rank p computes rows
[p * I_t / PCP, (p + 1) * I_t / PCP) of its TP shard's I_t intermediate rows, and one all-reduce over the
flattened TP x PCP group (the MoE group, `MoEShard.group`) sums the partials of every TP and PCP rank: each rank
streams 1/PCP of its MLP weights, and the all-reduce replaces the TP one. Prefill steps (each PCP rank holds
different tokens) run the whole shard as before.

Float weights are read through column views of the loaded shard (nothing copied). A quantized projection gets
its own copy of the slice, loaded in the same format (1/PCP of its bytes more per rank).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cpllm.distributed.comm import all_reduce
from cpllm.model.layers import ColumnParallelLinear, RowParallelLinear, RowRange, TPShard
from cpllm.model.loader import WeightSource
from cpllm.model.moe_placement import MoEShard


def split_rows(shard_rows: int, pcp_size: int, group_size: int = 32) -> int | None:
    """Intermediate rows per PCP rank, or None when the shard does not split evenly into whole quantization
    groups (the down projection's input is cut there)."""
    if shard_rows % pcp_size:
        return None
    rows = shard_rows // pcp_size
    return rows if rows % group_size == 0 else None


class DecodeSplitMLP(torch.nn.Module):
    """This PCP rank's slice of one TP shard's gate, up and down projections, for decode-only steps."""

    def __init__(self, prefix: str, hidden: int, intermediate: int, shard_start: int, shard_rows: int,
                 moe: MoEShard, dtype: torch.dtype, quantization: str):
        super().__init__()
        self.prefix, self.hidden, self.intermediate = prefix, hidden, intermediate
        self.shard_rows, self.dtype, self.quantization = shard_rows, dtype, quantization
        self.rows = shard_rows // moe.pcp_size
        self.offset = moe.pcp_rank * self.rows  # within the TP shard
        self.start = shard_start + self.offset  # within the whole intermediate dimension
        self.group = moe.group
        self.gate_up: ColumnParallelLinear | None = None
        """The quantized slice of gate|up (None: views of the float shard)."""
        self.down: RowParallelLinear | None = None
        """The quantized slice of down (None: a view of the float shard)."""

    def load_from(self, source: WeightSource, gate_up: ColumnParallelLinear, down: RowParallelLinear) -> None:
        """After the whole shard is loaded: quantized projections get their slice loaded in the same format."""
        if gate_up.weight is None:
            parts = [RowRange(name=f"{self.prefix}.{proj}", start=self.start, end=self.start + self.rows)
                     for proj in ("gate_proj", "up_proj")]
            self.gate_up = ColumnParallelLinear(self.hidden, parts, False, self.dtype, self.quantization)
            self.gate_up.load(source)
            self.gate_up.plans = []  # the start-up log lists each weight once (its bytes still count)
        if down.weight is None:
            # The slice is rank `start / rows` of the intermediate dimension cut into `rows`-row pieces.
            pieces = self.intermediate // self.rows
            at = TPShard(rank=self.start // self.rows, size=pieces, group=None)
            self.down = RowParallelLinear(f"{self.prefix}.down_proj", self.intermediate, self.hidden, at,
                                          self.dtype, self.quantization)
            self.down.load(source)
            self.down.plans = []

    def forward(self, x: torch.Tensor, gate_up: ColumnParallelLinear, down: RowParallelLinear) -> torch.Tensor:
        # x [N, hidden] -> this rank's partial of the MLP output [N, hidden], summed over TP x PCP
        if self.gate_up is None:
            w = gate_up.weight  # [hidden, 2 * shard_rows]: gate columns, then up columns
            gate = x @ w[:, self.offset: self.offset + self.rows]
            up = x @ w[:, self.shard_rows + self.offset: self.shard_rows + self.offset + self.rows]
        else:
            gate, up = self.gate_up(x).split(self.rows, dim=-1)
        h = F.silu(gate) * up
        # self.down's own group is None: its forward is the bare matmul, the sum is the all-reduce below
        partial = h @ down.weight[self.offset: self.offset + self.rows] if self.down is None else self.down(h)
        return all_reduce(partial, self.group)
