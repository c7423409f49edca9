"""The MoE router: which experts each token goes to, and with which weights, in float32.

Qwen3-MoE, Qwen2-MoE and Mixtral route alike in transformers: softmax over all experts' logits (float32), then
torch.topk (its tie order), then, when asked (always for Mixtral), the k probabilities renormalised to sum to
one, which equals a softmax over the top-k logits.
"""

from __future__ import annotations

import torch

from cpllm.model.loaders.loader import WeightSource


class Router(torch.nn.Module):
    """Replicated on every rank (E x hidden floats): every rank routes the tokens it holds."""

    def __init__(self, name: str, hidden: int, num_experts: int, top_k: int, renormalize: bool):
        super().__init__()
        self.name, self.top_k, self.renormalize = name, top_k, renormalize
        # [hidden, E], float32 whatever the model dtype, so routing never flips on rounding
        self.weight = torch.nn.Parameter(torch.empty(hidden, num_experts, dtype=torch.float32), requires_grad=False)

    def load(self, source: WeightSource) -> None:
        self.weight.copy_(source.get(self.name, dtype=torch.float32).t())

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x [N, hidden] -> weights [N, k] float32, expert ids [N, k] long
        probs = torch.softmax(x.float() @ self.weight, dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids
