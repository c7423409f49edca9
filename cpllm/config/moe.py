"""Mixture-of-experts shape and placement checks (no I/O, no torch).

A MoE model's experts are placed over the MoE group: the flattened TP x PCP ranks of one replica (size M; the
`moe` group of cpllm/distributed/parallel_dims.py, docs/context_parallel.md "Mixture of experts under PCP").
Expert-TP (default) splits every expert's intermediate dimension over M; expert parallelism
(`enable_expert_parallel`) gives each rank E / M whole experts. What cannot be placed is refused here (called by
`ParallelDims.validate`), with the values, before any process starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cpllm.config.linear_attention import HYBRID_MOE_ARCHITECTURES
from cpllm.config.routing import DeepseekRouting

MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM", "GptOssForCausalLM")
"""Hugging Face architectures whose MLPs are (partly) sparse mixtures of experts."""


@dataclass(kw_only=True, frozen=True, slots=True)
class MoEConfig:
    """The sparse MLP of a MoE model, read from config.json or GGUF metadata."""

    num_experts: int
    """Routed experts per sparse layer (E)."""
    top_k: int
    """Experts each token is routed to."""
    intermediate_size: int
    """Width of one routed expert's gated MLP."""
    norm_topk_prob: bool
    """Renormalise the top-k router probabilities to sum to one (always true for Mixtral)."""
    shared_expert_intermediate_size: int = 0
    """Width of the always-on shared expert (Qwen2-MoE, gated by a sigmoid; DeepSeek: n_shared_experts x
    intermediate_size, no gate); 0 = none."""
    decoder_sparse_step: int = 1
    """Layer i is sparse when (i + 1) % step == 0 and i is not in mlp_only_layers."""
    mlp_only_layers: tuple[int, ...] = ()
    """Layers that keep a dense MLP of the model's intermediate_size."""
    expert_prefix: str = "mlp"
    """Module name of the sparse block in HF checkpoints ("mlp"; Mixtral: "block_sparse_moe")."""
    expert_weight_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    """HF names of one expert's gate, up and down projections (Mixtral: w1, w3, w2)."""
    deepseek_router: DeepseekRouting | None = None
    """DeepSeek's router and ungated shared experts (cpllm/config/routing.py); None: the softmax top-k router."""
    swiglu_limit: float | None = None
    """GPT-OSS's clamped SwiGLU experts (cpllm/model/moe/gpt_oss_block.py): gate clamped to at most this, up to
    [-limit, limit]; None: the plain SiLU-gated experts."""
    swiglu_alpha: float = 1.702
    """GPT-OSS's SwiGLU gain: out = (up + 1) * gate * sigmoid(alpha * gate)."""

    def __post_init__(self) -> None:
        if self.num_experts < 1 or not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts={self.num_experts}, num_experts_per_tok={self.top_k}: need "
                             "1 <= num_experts_per_tok <= num_experts")
        if self.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step={self.decoder_sparse_step} must be >= 1")
        if self.deepseek_router is not None:
            self.deepseek_router.check(self.num_experts, self.top_k)

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer `layer` has a sparse MoE block (the rule of transformers' Qwen MoE models)."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "MoEConfig | None":
        """The MoE part of a config.json dictionary, or None for a dense architecture."""
        arch = (cfg.get("architectures") or [""])[0]
        if arch not in MOE_ARCHITECTURES and arch not in HYBRID_MOE_ARCHITECTURES:
            return None
        experts = cfg.get("num_experts") or cfg.get("num_local_experts")
        if arch == "GptOssForCausalLM":  # top-k of the logits, softmax over those k: normalised by construction
            return cls(num_experts=experts, top_k=cfg["num_experts_per_tok"],
                       intermediate_size=cfg["intermediate_size"], norm_topk_prob=True,
                       swiglu_limit=cfg.get("swiglu_limit", 7.0), swiglu_alpha=cfg.get("swiglu_alpha", 1.702))
        if arch == "MixtralForCausalLM":
            return cls(num_experts=experts, top_k=cfg["num_experts_per_tok"],
                       intermediate_size=cfg["intermediate_size"], norm_topk_prob=True,
                       expert_prefix="block_sparse_moe", expert_weight_names=("w1", "w3", "w2"))
        # Qwen2-MoE and the hybrids' gated shared expert; Qwen3.5-MoE always renormalises its top k
        shared = cfg.get("shared_expert_intermediate_size", 0) if arch in ("Qwen2MoeForCausalLM",
                                                                          *HYBRID_MOE_ARCHITECTURES) else 0
        if arch == "Qwen3_5MoeForCausalLM":
            cfg = {**cfg, "norm_topk_prob": True}
        return cls(num_experts=experts, top_k=cfg["num_experts_per_tok"],
                   intermediate_size=cfg["moe_intermediate_size"], norm_topk_prob=bool(cfg.get("norm_topk_prob")),
                   shared_expert_intermediate_size=shared or 0,
                   decoder_sparse_step=cfg.get("decoder_sparse_step", 1) or 1,
                   mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()))


def check_moe_placement(moe: MoEConfig, *, tp: int, pcp: int, expert_parallel: bool) -> None:
    """Refuse a layout the experts cannot be placed on (the MoE group is TP x PCP ranks)."""
    group = tp * pcp
    where = f"tensor_parallel_size={tp} x prefill_context_parallel_size={pcp} = {group} ranks"
    if expert_parallel and moe.num_experts % group != 0:
        raise ValueError(f"enable_expert_parallel: num_experts={moe.num_experts} is not divisible by the MoE group "
                         f"of {where}; use a group size that divides it, or expert-TP (the default)")
    if not expert_parallel and moe.intermediate_size % group != 0:
        raise ValueError(f"expert-TP: the expert intermediate size {moe.intermediate_size} is not divisible by the "
                         f"MoE group of {where}; use a group size that divides it, or enable_expert_parallel")
    if moe.shared_expert_intermediate_size % tp != 0:
        raise ValueError(f"shared_expert_intermediate_size={moe.shared_expert_intermediate_size} is not divisible "
                         f"by tensor_parallel_size={tp}")


def describe_placement(moe: MoEConfig, *, tp: int, pcp: int, expert_parallel: bool) -> str:
    """One line for the start-up log: how the experts are spread over the MoE group."""
    group = tp * pcp
    if expert_parallel:
        return (f"experts: expert parallel over TP x PCP = {group} ranks, {moe.num_experts // group} of "
                f"{moe.num_experts} whole experts per rank")
    return (f"experts: expert-TP over TP x PCP = {group} ranks, each rank holding {moe.intermediate_size // group} "
            f"of the {moe.intermediate_size} intermediate rows of every one of the {moe.num_experts} experts")
