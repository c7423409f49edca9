"""A Kimi delta attention layer (Kimi Linear) on one rank: its input projections, the causal convolution, the
forget gate, the delta rule with a per-channel decay (rule.py), the sigmoid-gated RMSNorm and the output
projection, over the rank's TP share of the heads.

As transformers' KimiLinearDeltaAttention computes it (H heads of width d for q, k and v alike):
    q | k | v = q_proj(x) | k_proj(x) | v_proj(x), each through its depthwise causal conv (q/k/v_conv1d) and silu
    q, k      L2-normalised per head (q also times d^-0.5)
    g         = -exp(A_log) softplus(f_b_proj(f_a_proj(x)) + dt_bias)     [N, H, d]: a log decay per key channel
    beta      = sigmoid(b_proj(x))                                       [N, H]
    o         = the delta rule's output                                  [N, H, d]
    out       = o_proj(RMSNorm(o) * w * sigmoid(g_b_proj(g_a_proj(x))))  the norm and gate per head, float32
Heads split over TP: a rank holds num_heads / TP whole heads (their rows of q/k/v, the convolution, f_b_proj,
g_b_proj, b_proj, dt_bias and A_log); the low-rank f_a_proj and g_a_proj (hidden -> d) and the norm's weight are
replicated, so no collective runs inside the layer but the output projection's all-reduce. Each request's state
lives in this layer's pools at its state slot (`RequestAttention.state_slot`), as the gated DeltaNet kind's does:
a chunk at position 0 starts from zeros, any other chunk from the slot's state (a prefix hit's restored
snapshot included), and leaves its own state there; a verify chunk leaves the state after its known tokens only,
its drafts scored from it and their updates dropped (`RequestAttention.num_draft_tokens`).
Under PCP a prompt chunk split over the PCP ranks goes through the gated DeltaNet kind's state scan
(cpllm/layers/gated_delta/pcp_prefill.py, with this layer's rule); single tokens run on every PCP rank alike.
"""

from __future__ import annotations

import torch

from cpllm.config.kimi_linear import KimiDeltaConfig
from cpllm.distributed.parallel_context import ParallelContext
from cpllm.layers.gated_delta.state_updates import DeltaStateUpdates
from cpllm.layers.kimi_delta.rule import chunked_kda, l2norm, recurrent_step
from cpllm.model.layers import ColumnParallelLinear, RowParallelLinear, RowRange

SOFTPLUS_LINEAR_ABOVE = 20.0
"""The forget gate's softplus(x) is x above this (transformers' bound: exp would overflow)."""


class SigmoidGatedRMSNorm(torch.nn.Module):
    """RMSNorm over each head's output times w times sigmoid(gate), all in float32 (the weight kept float32)."""

    def __init__(self, name: str, width: int, eps: float):
        super().__init__()
        self.name, self.eps = name, eps
        self.weight = torch.nn.Parameter(torch.empty(width, dtype=torch.float32), requires_grad=False)

    def load(self, source) -> None:
        self.weight.copy_(source.get(self.name, dtype=torch.float32))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps))
        return (normed * torch.sigmoid(gate.float())).to(x.dtype)


class KimiDeltaAttention(DeltaStateUpdates, torch.nn.Module):
    """hidden [N, hidden] -> [N, hidden]; reads and writes each request's state in the layer's pools."""

    chunk_rule = staticmethod(chunked_kda)
    """The chunked rule, for prompt chunks (state_updates.py) and the PCP state scan (pcp_prefill.py)."""
    step_rule = staticmethod(recurrent_step)
    """The recurrent step, for single tokens (state_updates.py)."""

    def __init__(self, kda: KimiDeltaConfig, hidden: int, prefix: str, parallel: ParallelContext,
                 dtype: torch.dtype, quantization: str):
        super().__init__()
        tp = parallel.comm("tp")
        self.linear, self.prefix, self.tp = kda, prefix, tp  # `linear`: the state scan reads its conv_kernel
        self.pcp = parallel.comm("pcp")
        d = kda.head_dim
        self.dk = self.dv = d
        self.hv = heads = kda.num_heads // tp.size
        self.h0 = h0 = tp.rank * heads
        self.conv_channels = 3 * heads * d
        mine = (h0 * d, (h0 + heads) * d)  # this rank's rows of a [H * d, ...] tensor
        self.in_proj = ColumnParallelLinear(hidden, [
            *(RowRange(name=f"{prefix}.{p}_proj", start=mine[0], end=mine[1]) for p in "qkv"),
            RowRange(name=f"{prefix}.f_a_proj", start=0, end=d), RowRange(name=f"{prefix}.g_a_proj", start=0, end=d),
            RowRange(name=f"{prefix}.b_proj", start=h0, end=h0 + heads),
        ], bias=False, dtype=dtype, quantization=quantization)
        self.f_b_proj, self.g_b_proj = (
            ColumnParallelLinear(d, [RowRange(name=f"{prefix}.{p}_b_proj", start=mine[0], end=mine[1])], bias=False,
                                 dtype=dtype, quantization=quantization) for p in "fg")
        self.conv_weight = torch.nn.Parameter(torch.empty(self.conv_channels, kda.conv_kernel, dtype=dtype),
                                              requires_grad=False)  # [q | k | v channels of this rank, taps]
        self.dt_bias = torch.nn.Parameter(torch.empty(heads * d, dtype=torch.float32), requires_grad=False)
        self.A_log = torch.nn.Parameter(torch.empty(heads, dtype=torch.float32), requires_grad=False)
        self.o_norm = SigmoidGatedRMSNorm(f"{prefix}.o_norm.weight", d, kda.norm_eps)
        self.o_proj = RowParallelLinear(f"{prefix}.o_proj", kda.qkv_dim, hidden, parallel, dtype, quantization)

    def load(self, source) -> None:
        """The convolutions' rows of this rank's heads, dt_bias and A_log (the projections and the norm load
        themselves). The checkpoint keeps q/k/v_conv1d [H * d, 1, taps] apart; A_log is stored [1, 1, H, 1]."""
        rows = (self.h0 * self.dk, (self.h0 + self.hv) * self.dk)
        conv = torch.cat([source.get(f"{self.prefix}.{p}_conv1d.weight", dim=0, start=rows[0], end=rows[1],
                                     dtype=self.conv_weight.dtype) for p in "qkv"])
        self.conv_weight.copy_(conv.reshape(self.conv_channels, -1))
        self.dt_bias.copy_(source.get(f"{self.prefix}.dt_bias", dim=0, start=rows[0], end=rows[1],
                                      dtype=torch.float32))
        a_log = source.get(f"{self.prefix}.A_log", dtype=torch.float32).reshape(-1)
        self.A_log.copy_(a_log[self.h0 : self.h0 + self.hv])

    def forward(self, hidden: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor], meta) -> torch.Tensor:
        n, hv, d = hidden.shape[0], self.hv, self.dk
        mixed, f_a, g_a, b = self.in_proj(hidden).split([self.conv_channels, d, d, hv], dim=-1)
        beta = b.sigmoid().float()  # [N, H]
        g = self._forget_gate(f_a)  # [N, H, d]
        core = torch.zeros(n, hv, d, dtype=torch.float32, device=hidden.device)
        self._update_states(meta, mixed, g, beta, state, core)
        gate = self.g_b_proj(g_a).view(n, hv, d)
        out = self.o_norm(core.to(hidden.dtype), gate).reshape(n, hv * d)
        return self.o_proj(out)

    def _forget_gate(self, f_a: torch.Tensor) -> torch.Tensor:
        """The log decay per key channel [N, H, d] (<= 0), float32."""
        x = (self.f_b_proj(f_a).float() + self.dt_bias).view(f_a.shape[0], self.hv, self.dk)
        softplus = torch.where(x > SOFTPLUS_LINEAR_ABOVE, x, torch.log(1.0 + torch.exp(x)))
        return -self.A_log.exp().unsqueeze(-1) * softplus

    def _heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Convolved channels [..., channels] -> q, k (normalised, q scaled), v [..., H, d], float32."""
        q, k, v = (part.unflatten(-1, (self.hv, self.dk)) for part in x.float().chunk(3, dim=-1))
        return l2norm(q) * self.dk**-0.5, l2norm(k), v
