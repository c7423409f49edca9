"""Tensor-parallel building blocks: each layer receives its TP group and loads only its own shard.

Linear layers, the embedding and the LM head take the engine's `quantization` mode; unless it is "none" they
ask cpllm/model/quant_plan.py which format each weight runs in, and record the answer in `plans` for the
start-up log. With "none" they run the float path and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cpllm.distributed.comm import all_gather, all_reduce
from cpllm.distributed.groups import PCPSplit
from cpllm.kernels.rms_norm import rms_norm
from cpllm.model import packed_weights
from cpllm.model.loader import WeightSource
from cpllm.model.quant_kernels import FloatLinear, Int4Linear, Int8Rows
from cpllm.model.quant_lm_head import RefinedInt8Head
from cpllm.model.quant_load import quantized_linear
from cpllm.model.quant_plan import WeightPlan, embedding_plan, fit_kernel, lm_head_plan, plan_packed, wanted_plan

NOT_QUANTIZED = WeightPlan("float", "quantization=none")


@dataclass(kw_only=True, frozen=True, slots=True)
class TPShard:
    """This rank's place in its tensor-parallel group."""

    rank: int = 0
    """Rank inside the TP group."""
    size: int = 1
    """Number of ranks in the TP group."""
    group: dist.ProcessGroup | None = None
    """The TP process group (None when size is 1)."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(x, self.group)

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        return all_gather(x, self.group, dim=-1)


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
        self.parts, self.quantization = parts, quantization
        out_features = sum(p.end - p.start for p in parts)
        # Stored transposed, [in, out]: x @ W streams the weight ~25% faster than F.linear for one-row decode.
        self.weight = torch.nn.Parameter(torch.empty(in_features, out_features, dtype=dtype), requires_grad=False)
        self.bias = (
            torch.nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        )
        self.pieces: torch.nn.ModuleList | None = None
        """Quantized: one linear per run of parts sharing a format, outputs concatenated; `weight` is then None."""
        self.packed: torch.Tensor | None = None
        """The float weight in oneDNN's layout, after pack_plain_weight; `weight` is then None."""
        self.plans: list[tuple[str, WeightPlan]] = []
        """(tensor name, plan) per packed part, for the start-up log."""

    def load(self, source: WeightSource) -> None:
        names = [f"{p.name}.weight" for p in self.parts]
        plans, runs = [NOT_QUANTIZED] * len(names), [("float", list(range(len(names))))]
        if self.quantization != "none":
            plans, runs = plan_packed(self.quantization, [source.storage_type(n) for n in names],
                                      self.weight.shape[0], cpu=self.weight.device.type == "cpu")
        self.plans = list(zip(names, plans))
        if all(fmt == "float" for fmt, _ in runs):
            self._load_float(source)
        else:
            self._load_pieces(source, runs)
        self._load_bias(source)

    def _load_float(self, source: WeightSource) -> None:
        offset = 0
        for part in self.parts:
            rows = part.end - part.start
            self.weight[:, offset : offset + rows] = source.get(
                f"{part.name}.weight", dim=0, start=part.start, end=part.end, dtype=self.weight.dtype
            ).t()
            offset += rows

    def _load_pieces(self, source: WeightSource, runs: list[tuple[str, list[int]]]) -> None:
        pieces = []
        for fmt, idx in runs:
            ranges = [(f"{self.parts[i].name}.weight", self.parts[i].start, self.parts[i].end) for i in idx]
            if fmt == "float":
                rows = [source.get(n, dim=0, start=s, end=e, dtype=self.weight.dtype) for n, s, e in ranges]
                pieces.append(FloatLinear(torch.cat(rows).t().contiguous()))
            else:
                pieces.append(quantized_linear(source, fmt, ranges))
        self.pieces, self.weight = torch.nn.ModuleList(pieces), None

    def _load_bias(self, source: WeightSource) -> None:
        offset = 0
        for part in self.parts if self.bias is not None else []:
            rows = part.end - part.start
            self.bias[offset : offset + rows] = source.get(
                f"{part.name}.bias", dim=0, start=part.start, end=part.end, dtype=self.bias.dtype
            )
            offset += rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [N, in] -> [N, out]
        if self.packed is not None:
            y = packed_weights.matmul(x, self.packed)
            return y + self.bias if self.bias is not None else y
        if self.pieces is None:
            return torch.addmm(self.bias, x, self.weight) if self.bias is not None else x @ self.weight
        y = self.pieces[0](x) if len(self.pieces) == 1 else torch.cat([p(x) for p in self.pieces], dim=-1)
        return y + self.bias if self.bias is not None else y


class RowParallelLinear(torch.nn.Module):
    """y = all_reduce(x_shard W_shard^T): input columns split over TP, partial sums reduced."""

    def __init__(self, name: str, in_features: int, out_features: int, tp: TPShard, dtype: torch.dtype,
                 quantization: str = "none"):
        super().__init__()
        self.name, self.tp, self.quantization = name, tp, quantization
        self.shard = in_features // tp.size
        self.weight = torch.nn.Parameter(torch.empty(self.shard, out_features, dtype=dtype), requires_grad=False)
        self.kernel: Int4Linear | None = None
        """The quantized shard, when the plan is int4 / int8; `weight` is then None."""
        self.packed: torch.Tensor | None = None
        """The float shard in oneDNN's layout, after pack_plain_weight; `weight` is then None."""
        self.plans: list[tuple[str, WeightPlan]] = []
        """(tensor name, plan), for the start-up log."""

    def load(self, source: WeightSource) -> None:
        name, start = f"{self.name}.weight", self.tp.rank * self.shard
        plan = NOT_QUANTIZED
        if self.quantization != "none":
            wanted = wanted_plan(self.quantization, source.storage_type(name), cpu=self.weight.device.type == "cpu")
            plan = fit_kernel(wanted, self.shard)
        self.plans = [(name, plan)]
        if plan.format != "float":  # groups never cross the shard's edges, so they are one rank's groups
            self.kernel = quantized_linear(source, plan.format, [(name, start, start + self.shard)], dim=1)
            self.weight = None
        else:
            self.weight.copy_(source.get(name, dim=1, start=start, end=start + self.shard, dtype=self.weight.dtype).t())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [N, in / TP] -> [N, out], summed over TP
        if self.packed is not None:
            return self.tp.all_reduce(packed_weights.matmul(x, self.packed))
        return self.tp.all_reduce(x @ self.weight if self.kernel is None else self.kernel(x))


def pack_plain_weight(linear: ColumnParallelLinear | RowParallelLinear) -> None:
    """Swap a linear's plain float [in, out] weight for oneDNN's packed layout (packed_weights.py), where it packs;
    quantized linears keep their kernels. Only for weights nothing else reads in place (the fused decode layers do)."""
    weight = linear.weight
    if weight is not None and packed_weights.packs(weight.dtype, weight.device):
        linear.packed, linear.weight = packed_weights.pack(weight.t()), None


def vocab_shard(vocab_size: int, tp: TPShard | PCPSplit) -> tuple[int, int]:
    """Vocabulary rows [start, end) of this rank (the last rank may hold fewer)."""
    per_rank = -(-vocab_size // tp.size)
    start = min(tp.rank * per_rank, vocab_size)
    return start, min(start + per_rank, vocab_size)


class VocabParallelEmbedding(torch.nn.Module):
    """Token embedding with rows split over TP; each rank embeds its ids, the sum is all-reduced."""

    def __init__(self, name: str, vocab_size: int, hidden: int, tp: TPShard, dtype: torch.dtype,
                 quantization: str = "none"):
        super().__init__()
        self.name, self.tp, self.dtype, self.quantization = name, tp, dtype, quantization
        self.start, self.end = vocab_shard(vocab_size, tp)
        self.weight = torch.nn.Parameter(torch.empty(self.end - self.start, hidden, dtype=dtype), requires_grad=False)
        self.int8_rows: Int8Rows | None = None
        """The rows as stored (Q8_0), when the plan is int8; `weight` is then None."""
        self.plans: list[tuple[str, WeightPlan]] = []
        """(tensor name, plan), for the start-up log."""

    def load(self, source: WeightSource) -> None:
        plan = NOT_QUANTIZED
        if self.quantization != "none":
            plan = embedding_plan(self.quantization, source.storage_type(self.name))
        self.plans = [(self.name, plan)]
        if plan.format == "int8":
            self.int8_rows = Int8Rows(source.get_int8_groups(self.name, dim=0, start=self.start, end=self.end))
            self.weight = None
        else:
            self.weight.copy_(source.get(self.name, dim=0, start=self.start, end=self.end, dtype=self.weight.dtype))

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        # ids [N] -> [N, hidden]
        return F.embedding(ids, self.weight) if self.int8_rows is None else self.int8_rows(ids, self.dtype)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self._rows(token_ids)
        in_shard = (token_ids >= self.start) & (token_ids < self.end)
        local_ids = torch.where(in_shard, token_ids - self.start, 0)
        out = self._rows(local_ids) * in_shard.unsqueeze(-1).to(self.dtype)
        return self.tp.all_reduce(out)


class ParallelLMHead(torch.nn.Module):
    """Logits over this rank's vocabulary rows, gathered over TP for sampling (float in every quantization mode,
    see cpllm/model/quant_plan.py)."""

    def __init__(self, embedding: VocabParallelEmbedding | None, name: str, vocab_size: int, hidden: int,
                 tp: TPShard, dtype: torch.dtype, quantization: str = "none", pcp: PCPSplit | None = None):
        """`pcp`: this rank's place in its PCP group when the PCP ranks split the head (each computes 1/PCP of
        this TP shard's rows, for rows every PCP rank holds; cpllm/worker/runner.py); None: one rank computes."""
        super().__init__()
        self.name, self.tp, self.vocab_size, self.quantization = name, tp, vocab_size, quantization
        self.pcp = pcp if pcp is not None and pcp.size > 1 else None
        self.split_kernel: Int4Linear | None = None
        """This PCP rank's rows of an int8 head in the kernel (a float head's are a view of `weight`)."""
        self.tied = embedding
        self.start, self.end = vocab_shard(vocab_size, tp)
        self.padded_rows = -(-vocab_size // tp.size)
        # [hidden, vocab shard]: a transposed copy even when tied, for the faster x @ W (see ColumnParallelLinear)
        self.weight = torch.nn.Parameter(torch.empty(hidden, self.end - self.start, dtype=dtype), requires_grad=False)
        self.kernel: RefinedInt8Head | None = None
        """The stored int8 rows in the int4 kernel, best logits refined in float32, when the plan is int8;
        `weight` is then None."""
        self.plans: list[tuple[str, WeightPlan]] = []
        """(tensor name, plan), for the start-up log."""

    def load(self, source: WeightSource) -> None:
        """Load after the embedding: a tied head copies its (already loaded) weight."""
        name = self.tied.name if self.tied is not None else self.name
        plan = NOT_QUANTIZED if self.quantization == "none" else lm_head_plan(
            self.quantization, source.storage_type(name), cpu=self.weight.device.type == "cpu")
        self.plans = [(self.name, plan)]
        if plan.format == "int8":
            shared = self.tied.int8_rows if self.tied is not None else None  # the same rows: one copy
            groups = source.get_int8_groups(name, dim=0, start=self.start, end=self.end)
            self.kernel, self.weight = RefinedInt8Head(groups, shared), None
        elif self.tied is not None and self.tied.weight is not None:
            self.weight.copy_(self.tied.weight.t())
        else:  # untied, or tied to an embedding that keeps its int8 rows
            self.weight.copy_(source.get(name, dim=0, start=self.start, end=self.end, dtype=self.weight.dtype).t())

    def pcp_rows(self) -> tuple[int, int]:
        """Rows [start, end) of this TP shard that this PCP rank computes."""
        return vocab_shard(self.end - self.start, self.pcp)

    def after_load(self, source: WeightSource) -> None:
        """Once loaded: an int8 head's PCP slice in the same kernel, from the same stored rows."""
        if self.pcp is None or self.kernel is None:
            return
        first, last = self.pcp_rows()
        name = self.tied.name if self.tied is not None else self.name
        self.split_kernel = Int4Linear.from_int8(
            source.get_int8_groups(name, dim=0, start=self.start + first, end=self.start + last))
        self.kernel.kernel = None  # every step now takes the split: only the stored rows (refinement) stay in use

    def _pcp_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden [M, hidden] (the same on every PCP rank) -> this TP shard's logits [M, end - start], float32.
        # Each column as the whole shard computes it; an int8 head then refines the joined rows' best logits, as
        # without the split.
        first, last = self.pcp_rows()
        part = (hidden @ self.weight[:, first:last] if self.split_kernel is None else self.split_kernel(hidden))
        part = part.float()
        pad = -(-(self.end - self.start) // self.pcp.size) - part.shape[-1]
        if pad:
            part = F.pad(part, (0, pad), value=float("-inf"))
        logits = all_gather(part, self.pcp.group, dim=-1)[:, : self.end - self.start]
        return logits if self.kernel is None else self.kernel.refine(hidden, logits)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden [num_rows, hidden] -> logits [num_rows, vocab] in float32 on every TP rank (and PCP rank, if split)
        if self.pcp is not None:
            logits = self._pcp_logits(hidden)
        else:
            logits = (hidden @ self.weight).float() if self.kernel is None else self.kernel(hidden)
        if self.tp.size == 1:
            return logits
        pad = self.padded_rows - logits.shape[-1]
        if pad:
            logits = F.pad(logits, (0, pad), value=float("-inf"))
        return self.tp.all_gather_last_dim(logits)[:, : self.vocab_size]


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
