"""Speculative rejection sampling: keep a drafted token or replace it, so the result has the target's distribution.

For a draft d drawn from q and a target distribution p: keep d with probability min(1, p(d) / q(d)); otherwise draw
from max(p - q, 0), normalised. P(token = t) = min(q(t), p(t)) + (1 - sum_s min(q(s), p(s))) * max(p(t) - q(t), 0)
/ sum_s max(p(s) - q(s), 0) = p(t). Prompt lookup's q is a point mass on d.
"""

from __future__ import annotations

import torch


def rejection_sample(probs: torch.Tensor, draft: int, generator: torch.Generator,
                     draft_probs: torch.Tensor | None = None) -> tuple[int, bool]:
    """Keep `draft` with probability min(1, p(d) / q(d)), else draw from the residual max(p - q, 0) normalised:
    the token then has distribution p whatever q is. `draft_probs` None: q is a point mass on the draft (prompt
    lookup), so the test is u < p(d) and the residual is p without d.

    probs, draft_probs: [vocab] on the generator's device. Returns (token, accepted)."""
    p_draft = float(probs[draft])
    q_draft = 1.0 if draft_probs is None else float(draft_probs[draft])
    u = float(torch.rand((), generator=generator, device=generator.device))
    if q_draft > 0 and u * q_draft < p_draft:
        return draft, True
    if draft_probs is None:
        residual = probs.clone()
        residual[draft] = 0.0
    else:
        residual = torch.clamp(probs - draft_probs, min=0.0)
    total = float(residual.sum())
    if not total > 0:  # p is all on the draft (then u < p(d) held) or numerically so: nothing else to draw
        return int(probs.argmax()), int(probs.argmax()) == draft
    return int(torch.multinomial(residual / total, 1, generator=generator)), False
