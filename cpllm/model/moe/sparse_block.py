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
from cpllm.distributed.comm import all_gather, all_reduce, reduce_scatter
from cpllm.model.layers import ColumnParallelLinear, RowParallelLinear, RowRange, TPShard
from cpllm.model.loaders.loader import WeightSource
from cpllm.model.moe.experts import LocalExperts
from cpllm.model.moe.placement import MoEShard, expert_slice
from cpllm.model.moe.router import Router


class SharedExpert(torch.nn.Module):
    """Qwen2-MoE's always-on expert: a TP-split gated MLP whose sum over TP is left to the caller."""

    def __init__(self, config: ModelConfig, prefix: str, tp: TPShard, dtype: torch.dtype):
        super().__init__()
        width = config.moe.shared_expert_intermediate_size
        shard = width // tp.size
        start = tp.rank * shard
        self.shard = shard
        self.gate_up_proj = ColumnParallelLinear(
            config.hidden_size,
            [RowRange(name=f"{prefix}.shared_expert.gate_proj", start=start, end=start + shard),
             RowRange(name=f"{prefix}.shared_expert.up_proj", start=start, end=start + shard)],
            bias=False, dtype=dtype, quantization=config.quantization,
        )
        # A TP shard without a group: this rank's columns, and no all-reduce (the MoE block's collective sums)
        partial = TPShard(rank=tp.rank, size=tp.size, group=None)
        self.down_proj = RowParallelLinear(f"{prefix}.shared_expert.down_proj", width, config.hidden_size, partial,
                                           dtype, config.quantization)
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

    def __init__(self, config: ModelConfig, prefix: str, shard: MoEShard, dtype: torch.dtype):
        super().__init__()
        moe = config.moe
        self.shard = shard
        self.gate = Router(f"{prefix}.gate.weight", config.hidden_size, moe.num_experts, moe.top_k,
                           moe.norm_topk_prob)
        held = expert_slice(moe.num_experts, moe.intermediate_size, shard)
        self.experts = LocalExperts(prefix, moe.expert_weight_names, config.hidden_size, held, dtype)
        self.shared_expert = (SharedExpert(config, prefix, shard.tp, dtype)
                              if moe.shared_expert_intermediate_size else None)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # x [N, hidden] (this rank's rows) -> [N, hidden]
        shard, n = self.shard, x.shape[0]
        same_rows = shard.pcp_size == 1 or meta.rows_same_over_pcp
        tokens = x if same_rows else all_gather(x, shard.pcp_group)  # [N or PCP*N, hidden]
        weights, ids = self.gate(tokens)
        partial = self.experts(tokens, weights, ids)
        if self.shared_expert is not None and (not same_rows or shard.pcp_rank == 0):
            mine = partial if same_rows else partial[shard.pcp_rank * n : (shard.pcp_rank + 1) * n]
            mine += self.shared_expert(x)  # counted once per row over the group
        if same_rows:
            return all_reduce(partial, shard.group)
        return all_reduce(reduce_scatter(partial, shard.pcp_group), shard.tp.group)


def moe_blocks(model: torch.nn.Module) -> list[SparseMoEBlock]:
    return [m for m in model.modules() if isinstance(m, SparseMoEBlock)]


def expert_bytes(model: torch.nn.Module) -> int:
    """Bytes of routed-expert weights this rank holds (loaded parameters)."""
    return sum(block.experts.nbytes for block in moe_blocks(model))
