"""The DeepSeek routers (V2 softmax, V3 / GLM-4.7-Flash sigmoid with groups), in float32 as transformers computes them.

Each step is the reference's own tensor operation in the same order (the logits through F.linear on the
[E, hidden] weight, torch.topk unsorted, masks by masked_fill), so the same inputs give the same expert ids,
in the same order, and the same weights bit for bit:
- softmax (V2): p = softmax(logits). "greedy": the top-k of p. "group_limited_greedy": each group of E / n_group
  consecutive experts is worth its best p; the experts outside the best `topk_group` groups get p = 0, then the
  top-k. The weights are the chosen p times routed_scaling_factor (never renormalised: transformers' V2 router
  does not read norm_topk_prob).
- sigmoid (V3, GLM-4.7-Flash; "noaux_tc"): s = sigmoid(logits), ranked as s + e_score_correction_bias. Each group
  is worth the sum of its two best biased scores; experts outside the best `topk_group` groups are ranked -inf;
  the top-k ids are taken, and weighed by their s without the bias, renormalised (sum + 1e-20) when
  norm_topk_prob, then times routed_scaling_factor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cpllm.config.routing import DeepseekRouting
from cpllm.model.loaders.loader import WeightSource


class DeepseekRouter(torch.nn.Module):
    """Replicated on every rank (E x hidden floats, + E for the bias): every rank routes the tokens it holds."""

    def __init__(self, prefix: str, hidden: int, num_experts: int, top_k: int, renormalize: bool,
                 routing: DeepseekRouting):
        super().__init__()
        self.prefix, self.top_k, self.renormalize, self.routing = prefix, top_k, renormalize, routing
        # [E, hidden] as stored, float32 whatever the model dtype: F.linear on it is the reference's product
        self.weight = torch.nn.Parameter(torch.empty(num_experts, hidden, dtype=torch.float32), requires_grad=False)
        self.correction = None
        if routing.scoring_func == "sigmoid":  # [E] selection-only correction (V3's e_score_correction_bias)
            self.correction = torch.nn.Parameter(torch.empty(num_experts, dtype=torch.float32), requires_grad=False)

    def load(self, source: WeightSource) -> None:
        self.weight.copy_(source.get(f"{self.prefix}.weight", dtype=torch.float32))
        if self.correction is not None:
            self.correction.copy_(source.get(f"{self.prefix}.e_score_correction_bias", dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x [N, hidden] -> weights [N, k] float32, expert ids [N, k] long
        logits = F.linear(x.float(), self.weight)  # [N, E]
        if self.routing.scoring_func == "softmax":
            return self._softmax_topk(logits)
        return self._noaux_tc(logits)

    def _group_mask(self, group_scores: torch.Tensor) -> torch.Tensor:
        # group_scores [N, G] -> [N, E] bool: the experts of each row's best topk_group groups
        groups = torch.topk(group_scores, k=self.routing.topk_group, dim=-1, sorted=False)[1]
        chosen = torch.zeros_like(group_scores).scatter_(1, groups, 1)
        n, g = group_scores.shape
        experts = self.weight.shape[0]
        return chosen.unsqueeze(-1).expand(n, g, experts // g).reshape(n, experts).bool()

    def _grouped(self, scores: torch.Tensor) -> torch.Tensor:
        # scores [N, E] -> [N, G, E / G]
        g = self.routing.n_group
        return scores.view(scores.shape[0], g, scores.shape[1] // g)

    def _softmax_topk(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = logits.softmax(dim=-1, dtype=torch.float32)  # [N, E]
        if self.routing.topk_method == "group_limited_greedy":
            keep = self._group_mask(self._grouped(probs).max(dim=-1).values)
            probs = probs.masked_fill(~keep, 0.0)
        weights, ids = torch.topk(probs, k=self.top_k, dim=-1, sorted=False)
        return weights * self.routing.routed_scaling_factor, ids

    def _noaux_tc(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = logits.sigmoid()  # [N, E]
        ranked = scores + self.correction  # the bias chooses experts, never weighs them
        keep = self._group_mask(self._grouped(ranked).topk(2, dim=-1)[0].sum(dim=-1))
        ranked = ranked.masked_fill(~keep, float("-inf"))
        ids = torch.topk(ranked, k=self.top_k, dim=-1, sorted=False)[1]  # [N, k]
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routing.routed_scaling_factor, ids
