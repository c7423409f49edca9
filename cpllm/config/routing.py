"""DeepSeek's router settings (no I/O, no torch): how its MoE blocks pick and weigh each token's experts. Read
by cpllm/config/deepseek.py from config.json, carried by MoEConfig.deepseek_router (cpllm/config/moe.py)."""

from __future__ import annotations

from dataclasses import dataclass

SCORING_FUNCS = ("softmax", "sigmoid")
TOPK_METHODS = {"softmax": ("greedy", "group_limited_greedy"), "sigmoid": ("noaux_tc",)}
"""The top-k selections each scoring function is combined with (transformers' V2 and V3 routers)."""


@dataclass(kw_only=True, frozen=True, slots=True)
class DeepseekRouting:
    """How a DeepSeek router picks and weighs each token's experts (every step in float32)."""

    scoring_func: str
    """"softmax" over all experts' logits (V2) or an independent "sigmoid" per expert (V3, GLM-4.7-Flash)."""
    topk_method: str
    """"greedy": the top-k scores; "group_limited_greedy": the top-k among the experts of the `topk_group`
    groups with the highest single score (V2); "noaux_tc": the top-k of score + e_score_correction_bias among
    the `topk_group` groups whose two best biased scores sum highest (V3)."""
    n_group: int = 1
    """Groups of consecutive experts (num_experts / n_group each) for the group-limited selections."""
    topk_group: int = 1
    """Groups a token's experts may come from."""
    routed_scaling_factor: float = 1.0
    """Factor on the routed experts' weights (after any renormalisation); the shared experts are not scaled."""
    n_shared_experts: int = 0
    """Always-on experts, run as one gated MLP of n_shared_experts x moe_intermediate_size rows, no gate."""

    def check(self, num_experts: int, top_k: int) -> None:
        """Refuse a routing that cannot pick `top_k` of `num_experts` experts (called by MoEConfig)."""
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(f"scoring_func={self.scoring_func!r}; supported: {', '.join(SCORING_FUNCS)}")
        methods = TOPK_METHODS[self.scoring_func]
        if self.topk_method not in methods:
            raise ValueError(f"topk_method={self.topk_method!r} with scoring_func={self.scoring_func!r}; "
                             f"supported: {', '.join(methods)}")
        if self.n_group < 1 or num_experts % self.n_group != 0:
            raise ValueError(f"n_group={self.n_group} must be >= 1 and divide n_routed_experts={num_experts}")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group={self.topk_group} must be in [1, n_group={self.n_group}]")
        per_group = num_experts // self.n_group
        if self.topk_method == "noaux_tc" and per_group < 2:
            raise ValueError(f"noaux_tc ranks groups by their two best experts: n_routed_experts={num_experts} / "
                             f"n_group={self.n_group} leaves {per_group} per group")
        if self.topk_method != "greedy" and top_k > self.topk_group * per_group:
            raise ValueError(f"num_experts_per_tok={top_k} exceeds the {self.topk_group * per_group} experts of "
                             f"topk_group={self.topk_group} groups of {per_group}")
        if self.n_shared_experts < 0:
            raise ValueError(f"n_shared_experts={self.n_shared_experts} must be >= 0")
