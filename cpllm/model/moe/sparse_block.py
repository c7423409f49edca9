"""A sparse mixture-of-experts block placed over the MoE group (flattened TP x PCP ranks; docs/context_parallel.md, "Mixture of experts under PCP").

Every rank routes the tokens it computes with the replicated router and runs its experts (or expert rows) on
the tokens routed to them; the partial outputs are summed over the group:
- rows differ over PCP (prefill, mixed steps, or single tokens split over PCP under the replicated KV layout):
  all-gather the PCP group's rows, compute partials for all of them, reduce-scatter over PCP (each rank gets
  its own rows back, summed over PCP) and all-reduce over TP. Every PCP rank's batch has the same padded row
  count, so the sizes are equal.
- every PCP rank holds the same rows (AttentionMetadata.rows_same_over_pcp: decode-only steps, sharded layout):
  no gather; one all-reduce over the flattened group.
The Qwen2-MoE shared expert is split over TP like a dense MLP and replicated over PCP; its TP partial (times its
sigmoid gate, a per-row scalar) joins the experts' partial, so it needs no collective of its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cpllm.config.engine import ModelConfig
from cpllm.context_parallel.metadata import AttentionMetadata
from cpllm.distributed.parallel_context import ParallelContext
from cpllm.model.layers import ColumnParallelLinear, RowParallelLinear, RowRange
from cpllm.model.loaders.loader import WeightSource
from cpllm.model.moe.experts import LocalExperts
from cpllm.model.moe.placement import expert_slice
from cpllm.model.moe.router import Router


class SharedExpert(torch.nn.Module):
    """Qwen2-MoE's always-on expert: a TP-split gated MLP whose sum over TP is left to the caller."""

    def __init__(self, config: ModelConfig, prefix: str, parallel: ParallelContext, dtype: torch.dtype):
        super().__init__()
        width = config.moe.shared_expert_intermediate_size
        tp = parallel.comm("tp")
        shard = width // tp.size
        start = tp.rank * shard
        self.shard = shard
        self.gate_up_proj = ColumnParallelLinear(
            config.hidden_size,
            [RowRange(name=f"{prefix}.shared_expert.gate_proj", start=start, end=start + shard),
             RowRange(name=f"{prefix}.shared_expert.up_proj", start=start, end=start + shard)],
            bias=False, dtype=dtype, quantization=config.quantization,
        )
        # This rank's columns, and no all-reduce (the MoE block's collective sums)
        self.down_proj = RowParallelLinear(f"{prefix}.shared_expert.down_proj", width, config.hidden_size, parallel,
                                           dtype, config.quantization, reduce=False)
        self.gate_name = f"{prefix}.shared_expert_gate.weight"
        self.gate = torch.nn.Parameter(torch.empty(config.hidden_size, 1, dtype=dtype), requires_grad=False)

    def load(self, source: WeightSource) -> None:
        # HF [1, hidden]; a GGUF file may store it as [hidden]
        self.gate.copy_(source.get(self.gate_name, dtype=self.gate.dtype).reshape(-1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [N, hidden] -> this TP rank's partial [N, hidden]
        gate, up = self.gate_up_proj(x).split(self.shard, dim=-1)
        return torch.sigmoid(x @ self.gate) * self.down_proj(F.silu(gate) * up)


class SparseMoEBlock(torch.nn.Module):
    """Router + this rank's experts (+ the shared expert), summed over the MoE group."""

    def __init__(self, config: ModelConfig, prefix: str, parallel: ParallelContext, dtype: torch.dtype):
        super().__init__()
        moe = config.moe
        self.place(parallel)
        self.gate = Router(f"{prefix}.gate.weight", config.hidden_size, moe.num_experts, moe.top_k,
                           moe.norm_topk_prob)
        held = expert_slice(moe.num_experts, moe.intermediate_size, parallel)
        self.experts = LocalExperts(prefix, moe.expert_weight_names, config.hidden_size, held, dtype)
        self.shared_expert = (SharedExpert(config, prefix, parallel, dtype)
                              if moe.shared_expert_intermediate_size else None)

    def place(self, parallel: ParallelContext) -> None:
        """The rank's parallel context and the three groups the block's collectives use (every subclass calls
        this): TP (the partials of the TP ranks holding the same tokens), PCP (tokens gathered over it, partial
        sums scattered back) and MoE (the flattened TP x PCP group: one all-reduce when every PCP rank holds the
        same rows)."""
        self.parallel = parallel
        self.tp, self.pcp, self.moe = parallel.comm("tp"), parallel.comm("pcp"), parallel.comm("moe")

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # x [N, hidden] (this rank's rows) -> [N, hidden]
        pcp, n = self.pcp, x.shape[0]
        same_rows = pcp.size == 1 or meta.rows_same_over_pcp
        tokens = x if same_rows else pcp.all_gather(x)  # [N or PCP*N, hidden]
        weights, ids = self.gate(tokens)
        partial = self.experts(tokens, weights, ids)
        if self.shared_expert is not None and (not same_rows or pcp.rank == 0):
            mine = partial if same_rows else partial[pcp.rank * n : (pcp.rank + 1) * n]
            mine += self.shared_expert(x)  # counted once per row over the group
        if same_rows:
            return self.moe.all_reduce(partial)
        return self.tp.all_reduce(pcp.reduce_scatter(partial))


def moe_blocks(model: torch.nn.Module) -> list[SparseMoEBlock]:
    return [m for m in model.modules() if isinstance(m, SparseMoEBlock)]


def expert_bytes(model: torch.nn.Module) -> int:
    """Bytes of routed-expert weights this rank holds (loaded parameters)."""
    return sum(block.experts.nbytes for block in moe_blocks(model))
