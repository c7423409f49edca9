"""The gated delta rule in torch, float32: the chunked form for a prompt chunk (one batched pass per block of
CHUNK tokens, the blocks scanned in order) and the recurrent step for single tokens.

Per value head, with the state S [dk, dv] (keys in, values out), a token (q, k, v, decay g <= 0 in log space,
learning rate beta) does S <- exp(g) S; S <- S + k (beta (v - S^T k))^T; out = S^T q. Over a block of C tokens
with G = cumsum(g) the same is, in the WY form transformers' torch path uses: solve (I + L) u = beta v and
(I + L) w = beta exp(G) k, L the strictly lower part of beta_i k_i . k_j exp(G_i - G_j); then per block
v' = u - w S, out = exp(G) q S + (q k^T . exp(G_i - G_j), lower) v', S <- exp(G_C) S + (exp(G_C - G) k)^T v'.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64
"""Tokens per block of the chunked form (transformers' chunk size)."""


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps) over the last dim (the normalisation of q and k)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunked_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's new tokens from `state`: q, k [T, H, dk] (normalised, q scaled), v [T, H, dv], g, beta
    [T, H], state [H, dk, dv], all float32 -> (out [T, H, dv], the state after the last token).

    Everything that does not read the state runs batched over all blocks; the scan over blocks is then three
    small matrix products per block (out = A + Q' S, v' = u - w S, S <- decay S + K'^T v', with A = intra u and
    Q' = exp(G) q - intra w precomputed), on block-major tensors so that each block is one contiguous slice."""
    t = q.shape[0]
    pad = (-t) % chunk
    n = (t + pad) // chunk

    def blocks(x):  # [T, H, ...] -> [n, H, C, ...], padded tokens (beta = 0, g = 0) write and decay nothing
        x = F.pad(x, (0, 0) * (x.dim() - 1) + (0, pad))
        return x.view(n, chunk, *x.shape[1:]).transpose(1, 2).contiguous()

    q, k, v, g, beta = (blocks(x) for x in (q, k, v, g, beta))
    cum = g.cumsum(-1)  # [n, H, C]
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()  # [n, H, C, C]
    k_beta = k * beta.unsqueeze(-1)
    system = (k_beta @ k.transpose(-1, -2)) * decay  # its strictly lower part is L
    dv = v.shape[-1]
    rhs = torch.cat([v * beta.unsqueeze(-1), k_beta * cum.exp().unsqueeze(-1)], dim=-1)  # one solve for u and w
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u, w = solved[..., :dv], solved[..., dv:]
    intra = (q @ k.transpose(-1, -2)) * decay  # [n, H, C, C], lower with the diagonal
    base = intra @ u  # the outputs' part that does not read the state
    q_state = q * cum.exp().unsqueeze(-1) - intra @ w  # what each output reads of the block's initial state
    k_decayed = (k * (cum[..., -1:] - cum).exp().unsqueeze(-1)).transpose(-1, -2).contiguous()  # [n, H, dk, C]
    block_decay = cum[..., -1].exp()[..., None, None]  # [n, H, 1, 1]
    u, w = u.contiguous(), w.contiguous()
    out = torch.empty_like(base)
    for i in range(n):  # the scan over blocks: each reads the state the previous one left
        out[i] = torch.baddbmm(base[i], q_state[i], state)
        v_new = torch.baddbmm(u[i], w[i], state, alpha=-1)
        state = torch.baddbmm(state * block_decay[i], k_decayed[i], v_new)
    return out.transpose(1, 2).reshape(n * chunk, *out.shape[1:2], dv)[:t], state


def recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B requests: q, k [B, H, dk], v [B, H, dv], g, beta [B, H], state [B, H, dk, dv]
    (float32) -> (out [B, H, dv], the new states)."""
    state = state * g.exp()[..., None, None]
    remembered = torch.einsum("bhk,bhkv->bhv", k, state)
    delta = (v - remembered) * beta.unsqueeze(-1)
    state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
    return torch.einsum("bhk,bhkv->bhv", q, state), state
