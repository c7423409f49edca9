"""The DeepSeek sparse block (DeepSeek-V2/V3, Kimi-K2, GLM-4.7-Flash): its router, the routed experts, shared experts.

It is a SparseMoEBlock (moe.py) with two parts swapped: the router is DeepseekRouter (deepseek_router.py) and the
shared experts are one ungated MLP of n_shared_experts x moe_intermediate_size rows that every token passes
through. The routed experts are the same LocalExperts on the same placement over the MoE group (expert-TP or
expert parallel, moe_placement.py), and the block's forward, with its collectives over TP x PCP, is the parent's:
the shared experts' TP partial rides in the experts' partial sum as the Qwen2-MoE shared expert does.

Checkpoint names under the block's prefix (`model.layers.{i}.mlp`): `gate.weight` [E, hidden],
`gate.e_score_correction_bias` [E] (V3, GLM), `experts.{e}.{gate,up,down}_proj.weight`,
`shared_experts.{gate,up,down}_proj.weight`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cpllm.config.moe import MoEConfig
from cpllm.model.moe.deepseek_router import DeepseekRouter
from cpllm.distributed.parallel_context import ParallelContext
from cpllm.model.layers import ColumnParallelLinear, RowParallelLinear, RowRange
from cpllm.model.moe.sparse_block import SparseMoEBlock
from cpllm.model.moe.experts import LocalExperts
from cpllm.model.moe.placement import expert_slice


class DeepseekSharedExperts(torch.nn.Module):
    """The always-on experts as one TP-split gated MLP (no gate on its output); the sum over TP is the caller's."""

    def __init__(self, hidden: int, width: int, prefix: str, parallel: ParallelContext, dtype: torch.dtype,
                 quantization: str):
        super().__init__()
        tp = parallel.comm("tp")
        shard = width // tp.size  # divisibility checked at config time (check_moe_placement)
        start = tp.rank * shard
        self.shard = shard
        self.gate_up_proj = ColumnParallelLinear(
            hidden,
            [RowRange(name=f"{prefix}.shared_experts.gate_proj", start=start, end=start + shard),
             RowRange(name=f"{prefix}.shared_experts.up_proj", start=start, end=start + shard)],
            bias=False, dtype=dtype, quantization=quantization,
        )
        # This rank's columns, and no all-reduce (the MoE block's collective sums)
        self.down_proj = RowParallelLinear(f"{prefix}.shared_experts.down_proj", width, hidden, parallel, dtype,
                                           quantization, reduce=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [N, hidden] -> this TP rank's partial [N, hidden]
        gate, up = self.gate_up_proj(x).split(self.shard, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DeepseekMoEBlock(SparseMoEBlock):
    """DeepseekRouter + this rank's experts + the shared experts, summed over the MoE group (SparseMoEBlock.forward)."""

    def __init__(self, hidden: int, moe: MoEConfig, prefix: str, parallel: ParallelContext, dtype: torch.dtype,
                 quantization: str = "none"):
        """`hidden`: the model's hidden size; `prefix`: the block's checkpoint prefix (`model.layers.{i}.mlp`);
        `quantization`: the model's mode, for the shared experts (routed experts run in `dtype`, as moe.py's)."""
        # The parent's parts are built here instead (its router and gated shared expert are not DeepSeek's), so
        # only the Module is initialised; forward, moe_blocks and the start-up log read the same attributes.
        torch.nn.Module.__init__(self)
        if moe.deepseek_router is None:
            raise ValueError("a DeepSeek MoE block needs MoEConfig.deepseek_router (cpllm/config/deepseek.py)")
        self.place(parallel)
        self.gate = DeepseekRouter(f"{prefix}.gate", hidden, moe.num_experts, moe.top_k, moe.norm_topk_prob,
                                   moe.deepseek_router)
        held = expert_slice(moe.num_experts, moe.intermediate_size, parallel)
        self.experts = LocalExperts(prefix, moe.expert_weight_names, hidden, held, dtype)
        width = moe.shared_expert_intermediate_size
        self.shared_expert = (DeepseekSharedExperts(hidden, width, prefix, parallel, dtype, quantization)
                              if width else None)
