"""Kimi delta attention's rule in torch, float32: the chunked form for a prompt chunk (one pass per block of CHUNK
tokens, in order) and the recurrent step for single tokens.

Per head, with the state S [dk, dv] (keys in, values out), a token (q, k, v, a decay g [dk] <= 0 in log space, one
per key channel, learning rate beta) does S <- diag(exp(g)) S; S <- S + k (beta (v - S^T k))^T; out = S^T q. It is
the gated delta rule (cpllm/layers/gated_delta/rule.py) with the head's scalar decay replaced by a diagonal one, so
every update is still S <- P_t S + k_t u_t^T, affine in S (the PCP state scan applies unchanged). Over a block of
C tokens with G = cumsum(g) per channel, the decay between tokens i >= j is exp(G_i - G_j) per channel, so the
block's pairwise products are sums over channels of the decayed terms (a [C, C, dk] tensor per head: the
differences are taken before the exponential, as transformers does, so nothing overflows); then the same WY form:
solve (I + L) u = beta v and (I + L) w = beta k exp(G), L the strictly lower part of sum_c beta_i k_ic k_jc
exp(G_ic - G_jc); v' = u - w S, out = (q exp(G)) S + (sum_c q_ic k_jc exp(G_ic - G_jc), lower) v',
S <- diag(exp(G_C)) S + (k exp(G_C - G))^T v'.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64
"""Tokens per block of the chunked form (transformers' chunk size)."""


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps) over the last dim (the normalisation of q and k, written as transformers' KDA path)."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunked_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's new tokens from `state`: q, k [T, H, dk] (normalised, q scaled), v [T, H, dv], g [T, H, dk],
    beta [T, H], state [H, dk, dv], all float32 -> (out [T, H, dv], the state after the last token)."""
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
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    out = torch.empty_like(v)
    for i in range(n):  # each block reads the state the previous one left
        qi, ki, vi, gi, bi = q[:, i], k[:, i], v[:, i], cum[:, i], beta[:, i].unsqueeze(-1)
        decay = (gi.unsqueeze(-2) - gi.unsqueeze(-3)).masked_fill(upper[..., None], float("-inf")).exp()
        k_beta = ki * bi
        system = (k_beta.unsqueeze(-2) * ki.unsqueeze(-3) * decay).sum(-1)  # [H, C, C]: its strictly lower part is L
        u = torch.linalg.solve_triangular(system, vi * bi, upper=False, unitriangular=True)
        w = torch.linalg.solve_triangular(system, k_beta * gi.exp(), upper=False, unitriangular=True)
        intra = (qi.unsqueeze(-2) * ki.unsqueeze(-3) * decay).sum(-1)  # lower with the diagonal
        v_new = u - w @ state
        out[:, i] = (qi * gi.exp()) @ state + intra @ v_new
        last = gi[:, -1:]  # [H, 1, dk]
        state = state * last.transpose(-1, -2).exp() + (ki * (last - gi).exp()).transpose(-1, -2) @ v_new
    return out.reshape(out.shape[0], n * chunk, -1)[:, :t].transpose(0, 1), state


def recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B requests: q, k [B, H, dk], v [B, H, dv], g [B, H, dk], beta [B, H], state
    [B, H, dk, dv] (float32) -> (out [B, H, dv], the new states)."""
    state = state * g.exp().unsqueeze(-1)
    remembered = torch.einsum("bhk,bhkv->bhv", k, state)
    delta = (v - remembered) * beta.unsqueeze(-1)
    state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
    return torch.einsum("bhk,bhkv->bhv", q, state), state
