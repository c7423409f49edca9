"""A gated DeltaNet layer (Qwen3.5, Qwen3-Next) on one rank: its input projections, the causal convolution, the
delta rule (rule.py), the gated RMSNorm and the output projection, over the rank's TP share of the heads.

Heads split over TP: a rank holds num_key_heads / TP whole key heads and the value heads they serve (consecutive:
value head j reads key head j // (num_value_heads / num_key_heads)), so no collective runs inside the layer but
the output projection's all-reduce. The state of each request lives in this layer's pools at the request's state
slot (`RequestAttention.state_slot`, set by the scheduler at admission): the convolution's last conv_kernel - 1
inputs and one delta-rule matrix per value head; a chunk at position 0 starts from zeros (a fresh request, or one
preempted and recomputed), any other chunk from the slot's state, and leaves its own state there. Under PCP a
prompt chunk is split over the PCP ranks and runs the state scan (pcp_prefill.py); single tokens run on every PCP
rank alike, so every PCP rank keeps the same states.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cpllm.config.linear_attention import LinearAttentionConfig
from cpllm.layers.gated_delta.pcp_prefill import pcp_prefill
from cpllm.layers.gated_delta.rule import chunked_delta_rule, l2norm, recurrent_step
from cpllm.distributed.parallel_context import GroupComm, ParallelContext
from cpllm.model.layers import ColumnParallelLinear, RowParallelLinear, RowRange


def projection_parts(linear: LinearAttentionConfig, prefix: str, tp: GroupComm) -> list[RowRange]:
    """This rank's rows of the input projections, packed as [q | k | v | z | b | a] (q and k of its key heads,
    v, z, b and a of its value heads), from separate tensors (Qwen3.5) or from the per-key-head fused ones
    (Qwen3-Next: in_proj_qkvz rows [q_h, k_h, v_h, z_h] and in_proj_ba rows [b_h, a_h] for each key head h)."""
    dk, dv = linear.key_head_dim, linear.value_head_dim
    hk, hv = linear.num_key_heads // tp.size, linear.num_value_heads // tp.size
    k0, v0 = tp.rank * hk, tp.rank * hv
    if not linear.fused_projections:
        qkv, key_dim = f"{prefix}.in_proj_qkv", linear.key_dim
        return [RowRange(name=qkv, start=k0 * dk, end=(k0 + hk) * dk),
                RowRange(name=qkv, start=key_dim + k0 * dk, end=key_dim + (k0 + hk) * dk),
                RowRange(name=qkv, start=2 * key_dim + v0 * dv, end=2 * key_dim + (v0 + hv) * dv),
                RowRange(name=f"{prefix}.in_proj_z", start=v0 * dv, end=(v0 + hv) * dv),
                RowRange(name=f"{prefix}.in_proj_b", start=v0, end=v0 + hv),
                RowRange(name=f"{prefix}.in_proj_a", start=v0, end=v0 + hv)]
    r = linear.num_value_heads // linear.num_key_heads
    qkvz, ba = f"{prefix}.in_proj_qkvz", f"{prefix}.in_proj_ba"
    block, heads = 2 * dk + 2 * r * dv, range(k0, k0 + hk)
    offsets = {"q": (0, dk), "k": (dk, 2 * dk), "v": (2 * dk, 2 * dk + r * dv), "z": (2 * dk + r * dv, block)}
    parts = [RowRange(name=qkvz, start=h * block + offsets[p][0], end=h * block + offsets[p][1])
             for p in "qkvz" for h in heads]
    parts += [RowRange(name=ba, start=h * 2 * r + o, end=h * 2 * r + o + r) for o in (0, r) for h in heads]
    return parts


class GatedRMSNorm(torch.nn.Module):
    """RMSNorm over each value head's output times silu(z), in float32 (the weight applied at the model dtype)."""

    def __init__(self, name: str, width: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.name, self.eps = name, eps
        self.weight = torch.nn.Parameter(torch.empty(width, dtype=dtype), requires_grad=False)

    def load(self, source) -> None:
        self.weight.copy_(source.get(self.name, dtype=self.weight.dtype))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (normed * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(torch.nn.Module):
    """hidden [N, hidden] -> [N, hidden]; reads and writes each request's state in the layer's pools."""

    chunk_rule = staticmethod(chunked_delta_rule)
    """The chunked rule pcp_prefill.py runs each run through."""

    def __init__(self, linear: LinearAttentionConfig, hidden: int, eps: float, prefix: str,
                 parallel: ParallelContext, dtype: torch.dtype, quantization: str):
        super().__init__()
        tp = parallel.comm("tp")
        self.linear, self.prefix, self.tp = linear, prefix, tp
        self.pcp = parallel.comm("pcp")  # a prompt chunk split over PCP ranks runs the state scan (pcp_prefill.py)
        self.dk, self.dv = linear.key_head_dim, linear.value_head_dim
        self.hk, self.hv = linear.num_key_heads // tp.size, linear.num_value_heads // tp.size
        self.conv_channels = 2 * self.hk * self.dk + self.hv * self.dv
        self.in_proj = ColumnParallelLinear(hidden, projection_parts(linear, prefix, tp), bias=False, dtype=dtype,
                                            quantization=quantization)
        self.conv_weight = torch.nn.Parameter(torch.empty(self.conv_channels, linear.conv_kernel, dtype=dtype),
                                              requires_grad=False)  # [channels of this rank, taps]
        self.dt_bias = torch.nn.Parameter(torch.empty(self.hv, dtype=dtype), requires_grad=False)
        self.A_log = torch.nn.Parameter(torch.empty(self.hv, dtype=dtype), requires_grad=False)
        self.norm = GatedRMSNorm(f"{prefix}.norm.weight", self.dv, eps, dtype)
        self.out_proj = RowParallelLinear(f"{prefix}.out_proj", linear.value_dim, hidden, parallel, dtype,
                                          quantization)

    def load(self, source) -> None:
        """The convolution's rows of this rank's q, k and v channels, and the value heads' decay parameters (the
        projections and the norm load themselves)."""
        k0, v0, key_dim, dtype = self.tp.rank * self.hk, self.tp.rank * self.hv, self.linear.key_dim, self.dt_bias.dtype
        name = f"{self.prefix}.conv1d.weight"
        rows = [(k0 * self.dk, (k0 + self.hk) * self.dk), (key_dim + k0 * self.dk, key_dim + (k0 + self.hk) * self.dk),
                (2 * key_dim + v0 * self.dv, 2 * key_dim + (v0 + self.hv) * self.dv)]
        conv = torch.cat([source.get(name, dim=0, start=a, end=b, dtype=dtype) for a, b in rows])
        self.conv_weight.copy_(conv.reshape(self.conv_channels, -1))  # stored [channels, 1, taps]
        for param, stored in ((self.dt_bias, "dt_bias"), (self.A_log, "A_log")):
            param.copy_(source.get(f"{self.prefix}.{stored}", dim=0, start=v0, end=v0 + self.hv, dtype=dtype))

    def forward(self, hidden: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor], meta) -> torch.Tensor:
        n = hidden.shape[0]
        hv, dv = self.hv, self.dv
        mixed, z, b, a = self.in_proj(hidden).split([self.conv_channels, hv * dv, hv, hv], dim=-1)
        beta = b.sigmoid().float()  # [N, Hv]
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # [N, Hv], log decay <= 0
        core = torch.zeros(n, hv, dv, dtype=torch.float32, device=hidden.device)
        singles = [r for r in meta.requests if r.local_chunks and r.num_new == 1]
        if singles:
            self._step(singles, mixed, g, beta, state, core)
        prompts = [r for r in meta.requests if r.num_new > 1]
        if prompts and self.pcp.size > 1:  # every PCP rank calls it alike: its collectives follow the metadata
            pcp_prefill(self, prompts, mixed, g, beta, state, core)
        for request in prompts if self.pcp.size == 1 else ():
            for run in request.local_chunks:
                known = run.length - request.num_draft_tokens  # a verify chunk's drafts leave the state as it was
                self._chunk(request, run.row, known, mixed, g, beta, state, core)
                if request.num_draft_tokens:
                    self._chunk(request, run.row + known, request.num_draft_tokens, mixed, g, beta, state, core,
                                fresh=False, commit=False)
        out = self.norm(core.to(hidden.dtype), z.reshape(n, hv, dv)).reshape(n, hv * dv)
        return self.out_proj(out)

    def _heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Convolved channels [..., channels] -> q, k [..., Hv, dk] (normalised, q scaled, key heads repeated over
        their value heads) and v [..., Hv, dv], float32."""
        hk, dk = self.hk, self.dk
        q, k, v = x.float().split([hk * dk, hk * dk, self.hv * self.dv], dim=-1)
        repeat = self.hv // hk
        q = l2norm(q.unflatten(-1, (hk, dk))).repeat_interleave(repeat, dim=-2) * dk**-0.5
        k = l2norm(k.unflatten(-1, (hk, dk))).repeat_interleave(repeat, dim=-2)
        return q, k, v.unflatten(-1, (self.hv, self.dv))

    def _step(self, requests, mixed, g, beta, state, core) -> None:
        """Single new tokens of several requests: one convolution tap window and one recurrent step each."""
        conv_pool, delta_pool = state
        rows = torch.tensor([r.local_chunks[0].row for r in requests], device=mixed.device)
        slots = torch.tensor([r.state_slot for r in requests], device=mixed.device)
        fresh = torch.tensor([r.start_pos == 0 for r in requests], device=mixed.device)
        window = conv_pool.index_select(0, slots).masked_fill(fresh[:, None, None], 0.0)  # [B, C, K - 1]
        taps = torch.cat([window, mixed.index_select(0, rows).float().unsqueeze(-1)], dim=-1)  # [B, C, K]
        x = F.silu((taps * self.conv_weight.float()).sum(-1)).to(mixed.dtype)  # [B, C]
        q, k, v = self._heads(x)
        matrix = delta_pool.index_select(0, slots).masked_fill(fresh[:, None, None], 0.0)
        matrix = matrix.view(len(requests), self.hv, self.dk, self.dv)
        out, matrix = recurrent_step(q, k, v, g.index_select(0, rows), beta.index_select(0, rows), matrix)
        core.index_copy_(0, rows, out)
        conv_pool.index_copy_(0, slots, taps[..., 1:])
        delta_pool.index_copy_(0, slots, matrix.reshape(len(requests), self.hv, -1))

    def _chunk(self, request, row: int, length: int, mixed, g, beta, state, core, *, fresh: bool | None = None,
               commit: bool = True) -> None:
        """`length` new tokens of one request from row `row`: the convolution over its window and tokens, the
        chunked delta rule. `fresh`: start from zeros (default: the chunk starts at position 0); `commit`: leave
        the state after them in the slot (False for a verify chunk's drafts: their rows are scored from the state
        of the known tokens, which stays, so a rejected draft leaves no trace; docs/context_parallel.md,
        "Speculative decoding on hybrids")."""
        conv_pool, delta_pool = state
        slot, keep = request.state_slot, self.linear.conv_kernel - 1
        fresh = not request.start_pos if fresh is None else fresh
        x = mixed[row : row + length].float().transpose(0, 1)  # [C, T]
        window = torch.zeros_like(conv_pool[slot]) if fresh else conv_pool[slot]
        taps = torch.cat([window, x], dim=-1)  # [C, K - 1 + T]
        conv = F.conv1d(taps.unsqueeze(0), self.conv_weight.float().unsqueeze(1), groups=self.conv_channels)[0]
        q, k, v = self._heads(F.silu(conv).transpose(0, 1).to(mixed.dtype))
        matrix = delta_pool[slot].view(self.hv, self.dk, self.dv)
        if fresh:
            matrix = torch.zeros_like(matrix)
        out, matrix = chunked_delta_rule(q, k, v, g[row : row + length], beta[row : row + length], matrix)
        core[row : row + length] = out
        if not commit:
            return
        conv_pool[slot] = taps[:, taps.shape[1] - keep:]
        delta_pool[slot] = matrix.reshape(self.hv, -1)
