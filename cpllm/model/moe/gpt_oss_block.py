"""GPT-OSS's sparse MLP on the shared expert placement (cpllm/model/moe/placement.py): its router, its experts
(biases, clamped SwiGLU) and the MoE block's collectives unchanged (cpllm/model/moe/sparse_block.py).

As transformers computes it (models/gpt_oss/modeling_gpt_oss.py):
- router: logits = x W^T + b; the top-k logits (torch.topk's order), then a softmax over those k alone. Run here
  in float32 whatever the model dtype, as the other families' routers are, so a choice never flips on rounding.
- experts: the checkpoint holds a layer's experts stacked, `experts.gate_up_proj` [E, hidden, 2I] with gate and
  up interleaved along the last axis (gate = [..., ::2], up = [..., 1::2]), its bias [E, 2I] likewise,
  `experts.down_proj` [E, I, hidden] and its bias [E, hidden]. With g = min(gate, limit) and
  u = clamp(up, -limit, limit) an expert computes ((u + 1) * g * sigmoid(alpha * g)) @ down + down_bias.
  The released checkpoints store both weights as MXFP4 blocks (`*_blocks`, `*_scales`; cpllm/model/formats/mxfp4.py).
Placement: expert-TP gives a rank rows [r0, r1) of every expert's intermediate dimension, i.e. the interleaved
columns [2 r0, 2 r1) of gate_up and its bias, and rows [r0, r1) of down; the down bias is one per expert, so only
MoE group rank 0 adds it (the partials are summed over the group). Expert parallel: whole experts, biases with
them.

MXFP4 experts under a quantization mode other than none run in the int4 kernel, per expert, from the stored blocks
(the plan: cpllm/model/formats/plan.py, `experts_plan`; the format's expert method: formats/experts.py): int8 =
the exact 8-bit form of the blocks (two 4-bit halves, twice the kernel's work), int4 = the blocks re-quantized to
even 4-bit levels (lossy), auto = the mode table's choice for MXFP4 (formats/modes.py, int8). Float checkpoints
keep float experts in every mode, as the other MoE families do.
"""

from __future__ import annotations

import torch

from cpllm.config.engine import QUANT_GROUP, ModelConfig
from cpllm.distributed.parallel_context import ParallelContext
from cpllm.model.formats.experts import MXFP4Weight
from cpllm.model.formats.loading import load_experts
from cpllm.model.formats.mxfp4 import dequantize_mxfp4
from cpllm.model.formats.plan import MXFP4_STORAGE, WeightPlan, experts_plan
from cpllm.model.loaders.loader import WeightSource
from cpllm.model.moe.sparse_block import SparseMoEBlock
from cpllm.model.moe.experts import LocalExperts
from cpllm.model.moe.placement import ExpertSlice, expert_slice


class TopKSoftmaxRouter(torch.nn.Module):
    """Replicated on every rank: a linear with bias, the top-k logits, a softmax over them (float32)."""

    def __init__(self, prefix: str, hidden: int, num_experts: int, top_k: int):
        super().__init__()
        self.prefix, self.top_k = prefix, top_k
        self.weight = torch.nn.Parameter(torch.empty(hidden, num_experts, dtype=torch.float32), requires_grad=False)
        self.bias = torch.nn.Parameter(torch.empty(num_experts, dtype=torch.float32), requires_grad=False)

    def load(self, source: WeightSource) -> None:
        self.weight.copy_(source.get(f"{self.prefix}.weight", dtype=torch.float32).t())  # HF [E, hidden]
        self.bias.copy_(source.get(f"{self.prefix}.bias", dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x [N, hidden] -> weights [N, k] float32, expert ids [N, k] long
        logits = torch.addmm(self.bias, x.float(), self.weight)  # [N, E]
        top, ids = torch.topk(logits, self.top_k, dim=-1)
        return torch.softmax(top, dim=-1), ids


def read_expert(source: WeightSource, name: str, expert: int, dtype: torch.dtype) -> torch.Tensor:
    """One expert of a stacked weight in HF layout ([hidden, 2I] for gate_up, [I, hidden] for down), from float
    tensors or dequantized from MXFP4 blocks (the stored [out, in] blocks, transposed back)."""
    if source.has(f"{name}_blocks"):
        blocks = source.get(f"{name}_blocks", dim=0, start=expert, end=expert + 1, dtype=torch.uint8)[0]
        scales = source.get(f"{name}_scales", dim=0, start=expert, end=expert + 1, dtype=torch.uint8)[0]
        return dequantize_mxfp4(blocks, scales, torch.float32).t().to(dtype)
    return source.get(name, dim=0, start=expert, end=expert + 1, dtype=dtype)[0]


def _mxfp4_rows(source: WeightSource, name: str, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    # one expert's blocks [out, G, 16] and scales [out, G]
    blocks = source.get(f"{name}_blocks", dim=0, start=expert, end=expert + 1, dtype=torch.uint8)[0]
    return blocks, source.get(f"{name}_scales", dim=0, start=expert, end=expert + 1, dtype=torch.uint8)[0]


class StackedExperts:
    """The ExpertReader of GPT-OSS's stacked expert tensors (`experts.gate_up_proj`, `experts.down_proj`, or their
    MXFP4 `_blocks` / `_scales`): this rank's rows of every held expert, gate|up de-interleaved."""

    def __init__(self, source: WeightSource, gate_up_name: str, down_name: str, held: ExpertSlice):
        self.source, self.gate_up_name, self.down_name, self.held = source, gate_up_name, down_name, held

    def quantized_storage(self) -> str | None:
        """MXFP4_STORAGE where the experts are stored as blocks, None for float tensors."""
        return MXFP4_STORAGE if self.source.has(f"{self.gate_up_name}_blocks") else None

    def fill_floats(self, expert: int, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        held, e = self.held, self.held.first_expert + expert
        cols = slice(2 * held.row_start, 2 * held.row_end)  # this rank's rows, still interleaved
        w = read_expert(self.source, self.gate_up_name, e, gate_up.dtype)[:, cols]  # [hidden, 2 rows]
        gate_up.copy_(torch.cat((w[:, 0::2], w[:, 1::2]), dim=1))
        down.copy_(read_expert(self.source, self.down_name, e, down.dtype)[held.row_start : held.row_end])

    def mxfp4(self, expert: int) -> tuple[MXFP4Weight, MXFP4Weight]:
        """Expert `expert`'s gate|up (this rank's rows, de-interleaved) and down (its input groups) as stored."""
        held, e = self.held, self.held.first_expert + expert
        blocks, scales = _mxfp4_rows(self.source, self.gate_up_name, e)  # [2I, G, 16]: output rows interleaved
        rows = torch.arange(2 * held.row_start, 2 * held.row_end)
        order = torch.cat((rows[0::2], rows[1::2]))  # gate rows, then up rows
        gate_up = MXFP4Weight(blocks=blocks[order], scales=scales[order])
        blocks, scales = _mxfp4_rows(self.source, self.down_name, e)  # [hidden, I / 32, 16]
        groups = slice(held.row_start // QUANT_GROUP, held.row_end // QUANT_GROUP)
        return gate_up, MXFP4Weight(blocks=blocks[:, groups], scales=scales[:, groups])


class GptOssExperts(LocalExperts):
    """The held experts (LocalExperts' expert method, in the format the plan picks), with biases and the clamped
    SwiGLU.

    gate|up are held de-interleaved, [gate rows | up rows] as LocalExperts holds them, so the activation reads two
    contiguous halves."""

    def __init__(self, prefix: str, hidden: int, held: ExpertSlice, dtype: torch.dtype, *, limit: float,
                 alpha: float, down_bias: bool, quantization: str = "none"):
        """`down_bias`: this rank adds the down projection's bias (one rank of the group under expert-TP)."""
        super().__init__(prefix, ("gate_up_proj", "gate_up_proj", "down_proj"), hidden, held, dtype)
        self.limit, self.alpha, self.adds_down_bias = limit, alpha, down_bias
        self.quantization, self.hidden = quantization, hidden
        self.plans: list[tuple[str, WeightPlan]] = []
        """(tensor name, plan) for the start-up log."""
        n, rows = held.num_experts, held.rows
        self.gate_up_bias = torch.nn.Parameter(torch.empty(n, 2 * rows, dtype=dtype), requires_grad=False)
        self.down_bias = torch.nn.Parameter(torch.zeros(n, hidden, dtype=dtype), requires_grad=False)

    def load(self, source: WeightSource) -> None:
        held, dtype = self.held, self.dtype
        cols = slice(2 * held.row_start, 2 * held.row_end)  # this rank's rows, still interleaved
        gate_up_name, down_name = f"{self.prefix}.experts.gate_up_proj", f"{self.prefix}.experts.down_proj"
        reader = StackedExperts(source, gate_up_name, down_name, held)
        plan = experts_plan(self.quantization, reader.quantized_storage(), (self.hidden, held.rows),
                            cpu=self.gate_up_bias.device.type == "cpu")
        self.plans = [(gate_up_name, plan), (down_name, plan)]
        for i in range(held.num_experts):
            e = held.first_expert + i
            b = source.get(f"{gate_up_name}_bias", dim=0, start=e, end=e + 1, dtype=dtype)[0, cols]
            self.gate_up_bias[i] = torch.cat((b[0::2], b[1::2]))
            if self.adds_down_bias:
                self.down_bias[i] = source.get(f"{down_name}_bias", dim=0, start=e, end=e + 1, dtype=dtype)[0]
        self.method = load_experts(reader, self.method, plan)

    def activation(self, h: torch.Tensor) -> torch.Tensor:
        # h [count, 2 rows] = gate | up (bias added) -> [count, rows], written over the gate half
        rows = self.held.rows
        gate = h[:, :rows].clamp_(max=self.limit)
        up = h[:, rows:].clamp_(-self.limit, self.limit)
        return gate.mul_(torch.sigmoid(gate * self.alpha)).mul_(up.add_(1))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        # x [T, hidden], weights / ids [T, k] -> this rank's partial output [T, hidden]
        out = torch.zeros_like(x)
        k = ids.shape[1]
        local = ids.flatten() - self.held.first_expert  # [T*k]
        pairs = ((local >= 0) & (local < self.held.num_experts)).nonzero().squeeze(1)
        if pairs.numel() == 0:
            return out
        pairs = pairs[torch.argsort(local[pairs], stable=True)]  # grouped by expert
        experts, tokens = local[pairs], pairs // k
        counts = torch.bincount(experts, minlength=self.held.num_experts).tolist()
        scale = weights.flatten()[pairs].to(x.dtype).unsqueeze(1)  # [S, 1]
        start, matmul = 0, self.method.matmul  # looked up once, not per expert
        for e, count in enumerate(counts):
            if count:
                mine = tokens[start : start + count]
                h = matmul(e, x.index_select(0, mine), 0).add_(self.gate_up_bias[e])  # [count, 2 rows]
                y = matmul(e, self.activation(h), 1)  # [count, hidden]
                if self.adds_down_bias:
                    y.add_(self.down_bias[e])
                out.index_add_(0, mine, y.mul_(scale[start : start + count]))
                start += count
        return out


class GptOssMoEBlock(SparseMoEBlock):
    """SparseMoEBlock's collectives over the MoE group with GPT-OSS's router and experts (no shared expert)."""

    def __init__(self, config: ModelConfig, prefix: str, parallel: ParallelContext, dtype: torch.dtype):
        torch.nn.Module.__init__(self)  # the parent's constructor builds the softmax router and SiLU experts
        moe = config.moe
        self.place(parallel)
        self.gate = TopKSoftmaxRouter(f"{prefix}.router", config.hidden_size, moe.num_experts, moe.top_k)
        held = expert_slice(moe.num_experts, moe.intermediate_size, parallel)
        self.experts = GptOssExperts(prefix, config.hidden_size, held, dtype, limit=moe.swiglu_limit,
                                     alpha=moe.swiglu_alpha, down_bias=parallel.dims.expert_parallel or parallel.rank("moe") == 0,
                                     quantization=config.quantization)
        self.shared_expert = None
