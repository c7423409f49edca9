"""Kimi delta attention's rule, float32: the chunked form for a prompt chunk (one pass per block of CHUNK tokens, in
order) and the recurrent step for single tokens. Each runs as a C kernel where it applies (cpllm/kernels/
kda_chunk.c, delta_step.c) and otherwise as its torch form here (`chunked_kda_torch`, `recurrent_step_torch`: the
fallbacks with CPLLM_KERNELS=0, and the kernels' references in tests).

Per head, with the state S [dk, dv] (keys in, values out), a token (q, k, v, a decay g [dk] <= 0 in log space, one
per key channel, learning rate beta) does S <- diag(exp(g)) S; S <- S + k (beta (v - S^T k))^T; out = S^T q. It is
the gated delta rule (cpllm/layers/gated_delta/rule.py) with the head's scalar decay replaced by a diagonal one, so
every update is still S <- P_t S + k_t u_t^T, affine in S (the PCP state scan applies unchanged). Over a block of
C tokens with G = cumsum(g) per channel, the decay between tokens i >= j is exp(G_i - G_j) per channel, so the
block's pairwise products are sums over channels of decayed terms (`_pairwise`). exp(G_i) and exp(-G_j) apart
would overflow; G falls along the block, so each sub-block of SUB tokens factors them about its first token r:
exp(G_i - G_r) for its rows and exp(G_r - G_j) for every earlier column, both <= 1, one matrix product; only the
SUB x SUB pairs inside a sub-block take the explicit [SUB, SUB, dk] differences. Then the same WY form:
solve (I + L) u = beta v and (I + L) w = beta k exp(G), L the strictly lower part of sum_c beta_i k_ic k_jc
exp(G_ic - G_jc); v' = u - w S, out = (q exp(G)) S + (sum_c q_ic k_jc exp(G_ic - G_jc), lower) v',
S <- diag(exp(G_C)) S + (k exp(G_C - G))^T v'.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cpllm.kernels.delta_chunk import delta_chunk
from cpllm.kernels.delta_step import delta_step

CHUNK = 64
"""Tokens per block of the chunked form (transformers' chunk size)."""
SUB = 8
"""Tokens per sub-block of a block's pairwise products (a divisor of CHUNK)."""


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps) over the last dim (the normalisation of q and k, written as transformers' KDA path)."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunked_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's new tokens from `state`: q, k [T, H, dk] (normalised, q scaled), v [T, H, dv], g [T, H, dk],
    beta [T, H], state [H, dk, dv], all float32 -> (out [T, H, dv], the state after the last token): the C kernel
    (cpllm/kernels/kda_chunk.c, per head over its blocks of CHUNK) where it applies, else `chunked_kda_torch`."""
    fast = delta_chunk(q, k, v, g, beta, state) if chunk == CHUNK else None
    return fast if fast is not None else chunked_kda_torch(q, k, v, g, beta, state, chunk)


def chunked_kda_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      state: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """`chunked_kda` in torch ops: the fallback, and the kernel's reference in tests."""
    t = q.shape[0]
    pad = (-t) % chunk
    # padded tokens have beta = 0 and g = 0: they write nothing and decay nothing
    q, k, v, g = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v, g))
    beta = F.pad(beta, (0, 0, 0, pad))
    n = (t + pad) // chunk

    def blocks(x):  # [T, H, ...] -> [H, n, C, ...]
        return x.transpose(0, 1).reshape(x.shape[1], n, chunk, *x.shape[2:])

    q, k, v, g, beta = (blocks(x) for x in (q, k, v, g, beta))
    cum = g.cumsum(-2)  # [H, n, C, dk]
    out = torch.empty_like(v)
    for i in range(n):  # each block reads the state the previous one left
        qi, ki, vi, gi, bi = q[:, i], k[:, i], v[:, i], cum[:, i], beta[:, i].unsqueeze(-1)
        k_beta = ki * bi
        # [H, C, C] each: the system's strictly lower part is L; intra is lower with the diagonal
        system, intra = _pairwise((k_beta, qi), ki, gi)
        u = torch.linalg.solve_triangular(system, vi * bi, upper=False, unitriangular=True)
        w = torch.linalg.solve_triangular(system, k_beta * gi.exp(), upper=False, unitriangular=True)
        v_new = u - w @ state
        out[:, i] = (qi * gi.exp()) @ state + intra @ v_new
        last = gi[:, -1:]  # [H, 1, dk]
        state = state * last.transpose(-1, -2).exp() + (ki * (last - gi).exp()).transpose(-1, -2) @ v_new
    return out.reshape(out.shape[0], n * chunk, -1)[:, :t].transpose(0, 1), state


def _pairwise(rows: tuple[torch.Tensor, ...], cols: torch.Tensor, cum: torch.Tensor,
              sub: int = SUB) -> list[torch.Tensor]:
    """For each x of `rows` [H, C, dk]: P[i, j] = sum_c x_ic cols_jc exp(cum_ic - cum_jc) for j <= i, 0 above
    (cum [H, C, dk] non-increasing along C) -> [H, C, C] each."""
    h, c, _ = cols.shape
    sub = min(sub, c)
    upper = torch.ones(sub, sub, dtype=torch.bool, device=cols.device).triu(1)
    outs = [cols.new_zeros(h, c, c) for _ in rows]
    for a in range(0, c, sub):
        mine, ref = slice(a, a + sub), cum[:, a : a + 1]  # the sub-block's rows, its first token's cumulative decay
        inside = (cum[:, mine].unsqueeze(-2) - cum[:, mine].unsqueeze(-3)).masked_fill(upper[..., None],
                                                                                    float("-inf")).exp()
        down = (cum[:, mine] - ref).exp()  # [H, sub, dk], <= 1
        earlier = (cols[:, :a] * (ref - cum[:, :a]).exp()).transpose(-1, -2) if a else None  # [H, dk, a], <= 1
        for x, out in zip(rows, outs):
            out[:, mine, mine] = (x[:, mine].unsqueeze(-2) * cols[:, mine].unsqueeze(-3) * inside).sum(-1)
            if earlier is not None:
                out[:, mine, :a] = (x[:, mine] * down) @ earlier
    return outs


def recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor, overwrite: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B requests: q, k [B, H, dk], v [B, H, dv], g [B, H, dk], beta [B, H], state
    [B, H, dk, dv] (float32) -> (out [B, H, dv], the new states): the C kernel (cpllm/kernels/delta_step.c, one pass
    over each state; with `overwrite` it may write the new states over `state`) where it applies, else
    `recurrent_step_torch`."""
    fast = delta_step(q, k, v, g, beta, state, overwrite)
    return fast if fast is not None else recurrent_step_torch(q, k, v, g, beta, state)


def recurrent_step_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`recurrent_step` in torch ops: the fallback, and the kernel's reference in tests."""
    state = state * g.exp().unsqueeze(-1)
    remembered = torch.einsum("bhk,bhkv->bhv", k, state)
    delta = (v - remembered) * beta.unsqueeze(-1)
    state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
    return torch.einsum("bhk,bhkv->bhv", q, state), state
