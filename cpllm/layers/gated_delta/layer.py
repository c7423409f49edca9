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
from cpllm.layers.gated_delta.rule import chunked_delta_rule, l2norm, recurrent_step
from cpllm.layers.gated_delta.state_updates import DeltaStateUpdates
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


class GatedDeltaNet(DeltaStateUpdates, torch.nn.Module):
    """hidden [N, hidden] -> [N, hidden]; reads and writes each request's state in the layer's pools."""

    chunk_rule = staticmethod(chunked_delta_rule)
    """The chunked rule, for prompt chunks (state_updates.py) and the PCP state scan (pcp_prefill.py)."""
    step_rule = staticmethod(recurrent_step)
    """The recurrent step, for single tokens (state_updates.py)."""

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
        self._update_states(meta, mixed, g, beta, state, core)
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
