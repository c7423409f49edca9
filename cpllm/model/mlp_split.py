"""A dense MLP's decode steps split over the PCP ranks (sharded KV layout).

In a decode-only step of the sharded layout every PCP rank holds the same tokens at the same rows
(`AttentionMetadata.rows_same_over_pcp`), and with the MLP weights replicated over PCP each rank would compute
the same MLP. Decode is bound by streaming weights, so instead each PCP rank computes 1/PCP of the output
columns of each projection, and two all-gathers over PCP join them:

    gate, up = x @ Wg[:, mine], x @ Wu[:, mine]      this rank's 1/PCP of the TP shard's intermediate columns
    h = all_gather(silu(gate) * up)                  [N, I_t], in PCP rank order = column order
    y = all_gather(h @ Wd[:, mine])                  this rank's 1/PCP of the hidden columns, joined
    y = all_reduce over TP                            as the unsplit path does

Every column is computed from the same inputs as without the split, so outputs equal the unsplit MLP (a split
along the reduction instead would round each partial on its own: the int4 kernel returns bfloat16, and greedy
decoding drifted within 20 tokens). Each rank streams 1/PCP of its MLP weights. Prefill steps (each PCP rank
holds different tokens) run the whole shard. Which steps split is the step plan's (`StepPlan.mlp_split`,
cpllm/context_parallel/plan.py); the MLP only follows it.

Plain float weights are read through column views of the loaded shard (nothing copied; `LinearMethod.columns`).
Other formats get their own copy of the slice, loaded in the same format from the same stored blocks (1/PCP of
their bytes more per rank); that needs the down projection's whole input on this rank, i.e. TP = 1 (otherwise the
split is not used).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cpllm.distributed.parallel_context import ParallelContext
from cpllm.model.layers import ColumnParallelLinear, RowParallelLinear, RowRange
from cpllm.model.loaders.loader import WeightSource


def can_split(shard_rows: int, hidden: int, pcp_size: int) -> bool:
    """Both splits are even: the TP shard's intermediate rows and the hidden size over the PCP ranks."""
    return pcp_size > 1 and shard_rows % pcp_size == 0 and hidden % pcp_size == 0


class DecodeSplitMLP(torch.nn.Module):
    """This PCP rank's columns of one TP shard's gate, up and down projections, for decode-only steps."""

    def __init__(self, prefix: str, hidden: int, shard_start: int, shard_rows: int, parallel: ParallelContext,
                 dtype: torch.dtype, quantization: str):
        super().__init__()
        self.prefix, self.hidden, self.dtype, self.quantization = prefix, hidden, dtype, quantization
        self.shard_start, self.shard_rows = shard_start, shard_rows
        self.tp, self.pcp = parallel.comm("tp"), parallel.comm("pcp")
        self.rows = shard_rows // self.pcp.size
        self.offset = self.pcp.rank * self.rows  # first intermediate column of this rank, within the TP shard
        self.out_cols = hidden // self.pcp.size
        self.out_offset = self.pcp.rank * self.out_cols
        self.usable = True
        """False when a quantized projection cannot be sliced here (TP > 1): decode then runs the whole shard."""
        self.gate_cols: torch.Tensor | None = None
        """[hidden, rows]: this rank's gate columns, a view of a plain float gate|up shard (else `gate_up`)."""
        self.up_cols: torch.Tensor | None = None
        """[hidden, rows]: the same for up."""
        self.gate_up: ColumnParallelLinear | None = None
        """This rank's slice of gate|up loaded in its format, where the shard's method has no plain view."""
        self.down_cols: torch.Tensor | None = None
        """[shard_rows, out_cols]: this rank's output columns of down, a view of a plain float shard (else `down`)."""
        self.down: ColumnParallelLinear | None = None
        """This rank's output columns of down loaded in its format, where the shard's method has no plain view."""

    def load_from(self, source: WeightSource, gate_up: ColumnParallelLinear, down: RowParallelLinear) -> None:
        """After the whole shard is loaded: views of plain float weights, the other formats' slices loaded."""
        self.down_cols = down.method.columns(self.out_offset, self.out_offset + self.out_cols)
        if self.down_cols is None and self.tp.size > 1:
            self.usable = False  # its input is a TP shard of a quantized tensor: no 2-D slice to load
            return
        self.gate_cols = gate_up.method.columns(self.offset, self.offset + self.rows)
        self.up_cols = gate_up.method.columns(self.shard_rows + self.offset, self.shard_rows + self.offset + self.rows)
        if self.gate_cols is None:
            start = self.shard_start + self.offset
            parts = [RowRange(name=f"{self.prefix}.{proj}", start=start, end=start + self.rows)
                     for proj in ("gate_proj", "up_proj")]
            self.gate_up = self._load_columns(source, self.hidden, parts)
        if self.down_cols is None:
            part = RowRange(name=f"{self.prefix}.down_proj", start=self.out_offset,
                            end=self.out_offset + self.out_cols)
            self.down = self._load_columns(source, self.shard_rows, [part])

    def _load_columns(self, source: WeightSource, in_features: int, parts: list[RowRange]) -> ColumnParallelLinear:
        linear = ColumnParallelLinear(in_features, parts, False, self.dtype, self.quantization)
        linear.load(source)
        linear.plans = []  # the start-up log lists each weight once (these bytes still count)
        return linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [N, hidden] -> MLP output [N, hidden], the same columns as the whole shard computes
        if self.gate_up is None:
            gate, up = x @ self.gate_cols, x @ self.up_cols
        else:
            gate, up = self.gate_up(x).split(self.rows, dim=-1)
        h = self.pcp.all_gather(F.silu(gate) * up, dim=-1)  # [N, shard_rows]
        y = h @ self.down_cols if self.down is None else self.down(h)
        return self.tp.all_reduce(self.pcp.all_gather(y, dim=-1))  # [N, hidden]
