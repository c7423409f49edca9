"""The gated delta rule, float32: the chunked form for a prompt chunk (one batched pass per block of CHUNK tokens,
the blocks scanned in order) and the recurrent step for single tokens. Each runs as a C kernel where it applies
(cpllm/kernels/delta_chunk.c, delta_step.c) and otherwise as its torch form here (`chunked_delta_rule_torch`,
`recurrent_step_torch`: the fallbacks with CPLLM_KERNELS=0, and the kernels' references in tests).

Per value head, with the state S [dk, dv] (keys in, values out), a token (q, k, v, decay g <= 0 in log space,
learning rate beta) does S <- exp(g) S; S <- S + k (beta (v - S^T k))^T; out = S^T q. Over a block of C tokens
with G = cumsum(g) the same is, in the WY form transformers' torch path uses: solve (I + L) u = beta v and
(I + L) w = beta exp(G) k, L the strictly lower part of beta_i k_i . k_j exp(G_i - G_j); then per block
v' = u - w S, out = exp(G) q S + (q k^T . exp(G_i - G_j), lower) v', S <- exp(G_C) S + (exp(G_C - G) k)^T v'.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cpllm.kernels.delta_chunk import delta_chunk
from cpllm.kernels.delta_step import delta_step

CHUNK = 64
"""Tokens per block of the chunked form (transformers' chunk size)."""


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps) over the last dim (the normalisation of q and k)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunked_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's new tokens from `state`: q, k [T, H, dk] (normalised, q scaled), v [T, H, dv], g, beta
    [T, H], state [H, dk, dv], all float32 -> (out [T, H, dv], the state after the last token): the C kernel
    (cpllm/kernels/delta_chunk.c, per head over its blocks of CHUNK) where it applies, else
    `chunked_delta_rule_torch`."""
    fast = delta_chunk(q, k, v, g, beta, state) if chunk == CHUNK else None
    return fast if fast is not None else chunked_delta_rule_torch(q, k, v, g, beta, state, chunk)


def chunked_delta_rule_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                             state: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """`chunked_delta_rule` in torch ops: the fallback, and the kernel's reference in tests."""
    t = q.shape[0]
    pad = (-t) % chunk
    # padded tokens have beta = 0 and g = 0: they write nothing and decay nothing
    q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, 0, 0, pad)) for x in (g, beta))
    n = (t + pad) // chunk

    def blocks(x):  # [T, H, ...] -> [H, n, C, ...]
        return x.transpose(0, 1).reshape(x.shape[1], n, chunk, *x.shape[2:])

    q, k, v, g, beta = (blocks(x) for x in (q, k, v, g, beta))
    cum = g.cumsum(-1)  # [H, n, C]
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()  # [H, n, C, C]
    k_beta = k * beta.unsqueeze(-1)
    system = (k_beta @ k.transpose(-1, -2)) * decay  # its strictly lower part is L
    u = torch.linalg.solve_triangular(system, v * beta.unsqueeze(-1), upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * cum.exp().unsqueeze(-1), upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * decay  # [H, n, C, C], lower with the diagonal
    q_decayed = q * cum.exp().unsqueeze(-1)
    k_decayed = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    block_decay = cum[..., -1].exp()[..., None, None]  # [H, n, 1, 1]
    out = torch.empty_like(u)
    for i in range(n):  # the scan over blocks: each reads the state the previous one left
        v_new = u[:, i] - w[:, i] @ state
        out[:, i] = q_decayed[:, i] @ state + intra[:, i] @ v_new
        state = state * block_decay[:, i] + k_decayed[:, i].transpose(-1, -2) @ v_new
    return out.reshape(out.shape[0], n * chunk, -1)[:, :t].transpose(0, 1), state


def recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor, overwrite: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B requests: q, k [B, H, dk], v [B, H, dv], g, beta [B, H], state [B, H, dk, dv]
    (float32) -> (out [B, H, dv], the new states): the C kernel (cpllm/kernels/delta_step.c, one pass
    over each state; with `overwrite` it may write the new states over `state`) where it applies, else
    `recurrent_step_torch`."""
    fast = delta_step(q, k, v, g, beta, state, overwrite)
    return fast if fast is not None else recurrent_step_torch(q, k, v, g, beta, state)


def recurrent_step_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`recurrent_step` in torch ops: the fallback, and the kernel's reference in tests."""
    state = state * g.exp()[..., None, None]
    remembered = torch.einsum("bhk,bhkv->bhv", k, state)
    delta = (v - remembered) * beta.unsqueeze(-1)
    state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
    return torch.einsum("bhk,bhkv->bhv", q, state), state
