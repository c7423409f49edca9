"""Tensor-parallel building blocks: each layer receives the rank's parallel context and loads only its own shard.

These layers hold the tensor-parallel logic (which rows or columns of which stored tensors a rank holds, the
bias, the collectives). The weight is a method of its weight format (cpllm/model/formats/), built at load by the
format the plan picks from the engine's `quantization` mode and how each tensor is stored (formats/plan.py,
formats/registry.py); the layers record each tensor's plan in `plans` for the start-up log. With "none" every
weight is plain float.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cpllm.distributed.parallel_context import GroupComm, ParallelContext
from cpllm.kernels.rms_norm import add_rms_norm, rms_norm
from cpllm.model.formats.methods import (EmbeddingRows, FloatHead, FloatRows, FloatWeight, FusedWeight, HeadMethod,
                                         LinearMethod, load_embedding, load_head, load_linear)
from cpllm.model.formats.plan import WeightPlan
from cpllm.model.loaders.loader import WeightSource


@dataclass(kw_only=True, frozen=True, slots=True)
class RowRange:
    """Rows [start, end) of one HF tensor that land in this rank's packed weight."""

    name: str
    start: int
    end: int


class ColumnParallelLinear(torch.nn.Module):
    """y = x W^T (+ b) with W's output rows split over TP; several HF tensors may be packed (q|k|v, gate|up)."""

    def __init__(self, in_features: int, parts: list[RowRange], bias: bool, dtype: torch.dtype,
                 quantization: str = "none"):
        super().__init__()
        self.parts, self.quantization, self.dtype = parts, quantization, dtype
        out_features = sum(p.end - p.start for p in parts)
        self.method: LinearMethod = FloatWeight.empty(in_features, out_features, dtype)
        """The weight in its format (unloaded float until `load`)."""
        self.bias = (
            torch.nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        )
        self.plans: list[tuple[str, WeightPlan]] = []
        """(tensor name, plan) per packed part, for the start-up log."""

    def load(self, source: WeightSource) -> None:
        ranges = [(f"{p.name}.weight", p.start, p.end) for p in self.parts]
        self.method, plans = load_linear(source, ranges, 0, self.method, self.quantization)
        self.plans = [(name, plan) for (name, _, _), plan in zip(ranges, plans)]
        self._load_bias(source)

    def _load_bias(self, source: WeightSource) -> None:
        offset = 0
        for part in self.parts if self.bias is not None else []:
            rows = part.end - part.start
            self.bias[offset : offset + rows] = source.get(
                f"{part.name}.bias", dim=0, start=part.start, end=part.end, dtype=self.bias.dtype
            )
            offset += rows

    def forward(self, x: torch.Tensor, native: bool = False) -> torch.Tensor:
        # x [N, in] (the model's dtype, or what input_dtype names) -> [N, out] in the model's dtype; `native`: in
        # the dtype the format rounded the product to (LinearMethod.matmul_native)
        y = self.method.matmul_native(x, self.bias)
        return y if native else y.to(self.dtype)

    def input_dtype(self, rows: int) -> torch.dtype | None:
        """As RowParallelLinear.input_dtype."""
        return self.method.input_dtype(rows)

    def fused_spec(self) -> FusedWeight | None:
        """The weight as the fused decode layer reads it (which adds no bias), or None."""
        return self.method.fused_spec() if self.bias is None else None

    def describe(self) -> str:
        return self.method.describe() + (" + bias" if self.bias is not None else "")

    def prepack(self) -> None:
        """The weight in its fastest layout (oneDNN's, for a float one); only for weights nothing else reads in
        place (the fused decode layers do)."""
        self.method = self.method.prepacked()


class RowParallelLinear(torch.nn.Module):
    """y = all_reduce(x_shard W_shard^T): input columns split over TP, partial sums reduced."""

    def __init__(self, name: str, in_features: int, out_features: int, parallel: ParallelContext,
                 dtype: torch.dtype, quantization: str = "none", *, reduce: bool = True):
        """`reduce`: sum the TP ranks' partials here (False: the caller sums this rank's partial with others', as
        the MoE blocks' shared experts ride in the experts' sum)."""
        super().__init__()
        self.name, self.tp, self.quantization, self.reduce = name, parallel.comm("tp"), quantization, reduce
        self.dtype = dtype
        """The model's dtype: every output but a `native` one is in it."""
        self.shard = in_features // self.tp.size
        self.method: LinearMethod = FloatWeight.empty(self.shard, out_features, dtype)
        """This rank's input shard of the weight in its format (unloaded float until `load`)."""
        self.plans: list[tuple[str, WeightPlan]] = []
        """(tensor name, plan), for the start-up log."""

    def load(self, source: WeightSource) -> None:
        name, start = f"{self.name}.weight", self.tp.rank * self.shard
        self.method, plans = load_linear(source, [(name, start, start + self.shard)], 1, self.method,
                                         self.quantization)
        self.plans = [(name, plans[0])]

    def forward(self, x: torch.Tensor, native: bool = False) -> torch.Tensor:
        # x [N, in / TP] -> [N, out], summed over TP (or this rank's partial, without `reduce`); `native`: in the
        # dtype the format rounded the product to where nothing is summed over ranks (a sum of bf16 partials would
        # round differently)
        y = self.method.matmul_native(x)
        if native and self.tp.size == 1 and self.reduce:
            return y
        partial = y.to(self.dtype)
        return self.tp.all_reduce(partial) if self.reduce else partial

    def input_dtype(self, rows: int) -> torch.dtype | None:
        """The dtype `rows` rows of input are rounded to first (LinearMethod.input_dtype), or None."""
        return self.method.input_dtype(rows)

    def fused_spec(self) -> FusedWeight | None:
        """The shard as the fused decode layer reads it, or None."""
        return self.method.fused_spec()

    def describe(self) -> str:
        return self.method.describe()

    def prepack(self) -> None:
        """As ColumnParallelLinear.prepack."""
        self.method = self.method.prepacked()


def vocab_shard(vocab_size: int, shard: GroupComm) -> tuple[int, int]:
    """Vocabulary rows [start, end) of this rank of the group `shard` (the last rank may hold fewer)."""
    per_rank = -(-vocab_size // shard.size)
    start = min(shard.rank * per_rank, vocab_size)
    return start, min(start + per_rank, vocab_size)


class VocabParallelEmbedding(torch.nn.Module):
    """Token embedding with rows split over TP; each rank embeds its ids, the sum is all-reduced."""

    def __init__(self, name: str, vocab_size: int, hidden: int, parallel: ParallelContext, dtype: torch.dtype,
                 quantization: str = "none"):
        super().__init__()
        self.name, self.tp, self.dtype, self.quantization = name, parallel.comm("tp"), dtype, quantization
        self.start, self.end = vocab_shard(vocab_size, self.tp)
        self.rows: EmbeddingRows = FloatRows(self.end - self.start, hidden, dtype)
        """This shard's rows in their format (unloaded float until `load`)."""
        self.plans: list[tuple[str, WeightPlan]] = []
        """(tensor name, plan), for the start-up log."""

    def load(self, source: WeightSource) -> None:
        self.rows, plan = load_embedding(source, self.name, self.start, self.end, self.rows, self.quantization)
        self.plans = [(self.name, plan)]

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        # token_ids [N] -> [N, hidden]
        if self.tp.size == 1:
            return self.rows.lookup(token_ids)
        in_shard = (token_ids >= self.start) & (token_ids < self.end)
        local_ids = torch.where(in_shard, token_ids - self.start, 0)
        out = self.rows.lookup(local_ids) * in_shard.unsqueeze(-1).to(self.dtype)
        return self.tp.all_reduce(out)


class ParallelLMHead(torch.nn.Module):
    """Logits over this rank's vocabulary rows, gathered over TP for sampling (the model dtype, or a Q8_0 head's
    int8 rows with each row's best logits refined in float32: cpllm/model/formats/plan.py)."""

    def __init__(self, embedding: VocabParallelEmbedding | None, name: str, vocab_size: int, hidden: int,
                 parallel: ParallelContext, dtype: torch.dtype, quantization: str = "none", *,
                 split_over_pcp: bool = False):
        """`split_over_pcp`: the PCP ranks split the head (each computes 1/PCP of this TP shard's rows, for rows
        every PCP rank holds; cpllm/worker/runner.py); False, or one PCP rank: one rank computes."""
        super().__init__()
        self.name, self.tp, self.vocab_size, self.quantization = name, parallel.comm("tp"), vocab_size, quantization
        pcp = parallel.comm("pcp")
        self.pcp = pcp if split_over_pcp and pcp.size > 1 else None
        self.tied = embedding
        self.start, self.end = vocab_shard(vocab_size, self.tp)
        self.padded_rows = -(-vocab_size // self.tp.size)
        self.method: HeadMethod = FloatHead(hidden, self.end - self.start, dtype)
        """This shard's weight in its format (unloaded float until `load`)."""
        self.plans: list[tuple[str, WeightPlan]] = []
        """(tensor name, plan), for the start-up log."""

    def _stored_name(self) -> str:
        return self.tied.name if self.tied is not None else self.name

    def load(self, source: WeightSource) -> None:
        """Load after the embedding: a tied head shares or copies its (already loaded) rows."""
        self.method, plan = load_head(source, self._stored_name(), self.start, self.end, self.method,
                                      self.tied.rows if self.tied is not None else None, self.quantization)
        self.plans = [(self.name, plan)]

    def pcp_rows(self) -> tuple[int, int]:
        """Rows [start, end) of this TP shard that this PCP rank computes."""
        return vocab_shard(self.end - self.start, self.pcp)

    def after_load(self, source: WeightSource) -> None:
        """Once loaded: the method computes this PCP rank's rows only (an int8 head loads them in the same kernel,
        from the same stored rows)."""
        if self.pcp is not None:
            self.method.split(source, self._stored_name(), self.start, *self.pcp_rows())

    def _pcp_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden [M, hidden] (the same on every PCP rank) -> this TP shard's logits [M, end - start], float32.
        # Each column as the whole shard computes it; an int8 head then refines the joined rows' best logits, as
        # without the split.
        part = self.method.part_logits(hidden).float()
        pad = -(-(self.end - self.start) // self.pcp.size) - part.shape[-1]
        if pad:
            part = F.pad(part, (0, pad), value=float("-inf"))
        logits = self.pcp.all_gather(part, dim=-1)[:, : self.end - self.start]
        return self.method.refine(hidden, logits)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden [num_rows, hidden] -> logits [num_rows, vocab] in float32 on every TP rank (and PCP rank, if split)
        logits = self._pcp_logits(hidden) if self.pcp is not None else self.method.logits(hidden)
        if self.tp.size == 1:
            return logits
        pad = self.padded_rows - logits.shape[-1]
        if pad:
            logits = F.pad(logits, (0, pad), value=float("-inf"))
        return self.tp.all_gather(logits, dim=-1)[:, : self.vocab_size]


class RMSNorm(torch.nn.Module):
    """Replicated RMSNorm, computed in float32 like transformers."""

    def __init__(self, name: str, hidden: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.name, self.eps = name, eps
        self.weight = torch.nn.Parameter(torch.empty(hidden, dtype=dtype), requires_grad=False)

    def load(self, source: WeightSource) -> None:
        self.weight.copy_(source.get(self.name, dtype=self.weight.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # one pass (C kernel, eager CPU) or one op instead of seven; in float32 the same formula as below
            out = rms_norm(x, self.weight, self.eps)
            return out if out is not None else F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, delta: torch.Tensor | None,
                     out_dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, its norm in `out_dtype`) for a float32 residual x (delta None: x itself), the norm rounded
        to bfloat16 here for a consumer that rounds its input to it first (out_dtype; None: x's dtype), in one
        pass where the kernel runs (cpllm/kernels/rms_norm.c): the bits of the add, this norm and the cast."""
        out_dtype = x.dtype if out_dtype is None else out_dtype
        fused = add_rms_norm(x, delta, self.weight, self.eps, out_dtype) if x.dtype == torch.float32 else None
        if fused is not None:
            return fused
        total = x if delta is None else x + delta
        return total, self(total).to(out_dtype)
