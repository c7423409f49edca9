"""The DeepSeek mixture of experts (DeepSeek-V2/V3, Kimi-K2, GLM-4.7-Flash) read from config.json (no I/O, no torch).

These models' sparse layers differ from the Qwen / Mixtral ones in three ways, all described here:
- the router (`DeepseekRouting`): V2 ranks softmax probabilities, greedily or within the best expert groups
  ("group_limited_greedy"); V3 and GLM-4.7-Flash rank sigmoid scores plus a per-expert correction bias inside
  the groups with the best sum of their two best scores ("noaux_tc"), then weigh each chosen expert by its
  sigmoid score without the bias; both scale the weights by `routed_scaling_factor`;
- shared experts: `n_shared_experts` experts of `moe_intermediate_size` every token passes through, stored as
  one MLP of n_shared_experts x moe_intermediate_size rows with no gate (`MoEConfig.shared_expert_intermediate_size`);
- which layers are sparse: `first_k_dense_replace` and `moe_layer_freq` (V2, V3), or GLM's `mlp_layer_types`,
  recorded as `MoEConfig.mlp_only_layers`.
What transformers 5.24 computes is the reference; where it ignores a config.json field, so does cpllm (below).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cpllm.config.moe import MoEConfig
from cpllm.config.routing import DeepseekRouting

DEEPSEEK_MOE_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Glm4MoeLiteForCausalLM",
                              "DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM")
"""Hugging Face architectures whose sparse layers are DeepSeek MoE blocks and whose attention is MLA (MLAConfig;
cpllm/model/families/deepseek.py builds them)."""
HF_DEFAULTS = {
    "DeepseekV2ForCausalLM": dict(routed_scaling_factor=1.0, n_shared_experts=2,
                                  first_k_dense_replace=0, topk_method="greedy", norm_topk_prob=False),
    "DeepseekV3ForCausalLM": dict(n_group=8, topk_group=4, routed_scaling_factor=2.5, n_shared_experts=1,
                                  first_k_dense_replace=3, norm_topk_prob=True),
    "Glm4MoeLiteForCausalLM": dict(n_group=1, topk_group=1, routed_scaling_factor=1.8, n_shared_experts=1,
                                   norm_topk_prob=True),
    # the sparse-MLA families (cpllm/config/sparse_mla.py): V3's router and shared experts
    "DeepseekV32ForCausalLM": dict(n_group=8, topk_group=4, routed_scaling_factor=2.5, n_shared_experts=1,
                                   first_k_dense_replace=3, norm_topk_prob=True),
    "GlmMoeDsaForCausalLM": dict(n_group=1, topk_group=1, routed_scaling_factor=2.5, n_shared_experts=1,
                                 first_k_dense_replace=3, norm_topk_prob=True),
}
"""transformers 5.24's config defaults of each family, for a field config.json leaves out."""


def dense_layers(cfg: dict[str, Any], arch: str, num_layers: int) -> tuple[int, ...]:
    """The layers that keep a dense MLP of `intermediate_size`.

    V2 / V3: layer i is sparse when i >= first_k_dense_replace and i % moe_layer_freq == 0 (DeepSeek's rule;
    transformers 5.24 reads no moe_layer_freq and makes every layer from first_k_dense_replace on sparse, the same
    layers for moe_layer_freq = 1, which every published checkpoint uses). GLM-4.7-Flash: `mlp_layer_types`,
    by default the first layer dense (transformers' default; it reads no first_k_dense_replace)."""
    if arch in ("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM"):  # mlp_layer_types, else first_k_dense_replace
        first = min(cfg.get("first_k_dense_replace", 3), num_layers)
        default = ["dense"] * first + ["sparse"] * (num_layers - first)
        cfg = {**cfg, "mlp_layer_types": cfg.get("mlp_layer_types") or default}
    if arch in ("Glm4MoeLiteForCausalLM", "DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM"):
        types = cfg.get("mlp_layer_types") or ["dense"] + ["sparse"] * (num_layers - 1)
        if len(types) != num_layers or set(types) - {"dense", "sparse"}:
            raise ValueError(f"mlp_layer_types={types} must name 'dense' or 'sparse' for each of {num_layers} layers")
        return tuple(i for i, kind in enumerate(types) if kind == "dense")
    first = cfg.get("first_k_dense_replace", 0)
    freq = cfg.get("moe_layer_freq", 1)
    if first < 0 or freq < 1:
        raise ValueError(f"first_k_dense_replace={first} must be >= 0 and moe_layer_freq={freq} >= 1")
    return tuple(i for i in range(num_layers) if i < first or i % freq != 0)


def deepseek_moe_config(cfg: dict[str, Any]) -> MoEConfig:
    """The MoE part of a DeepSeek-V2 / V3 / GLM-4.7-Flash config.json dictionary."""
    arch = (cfg.get("architectures") or [""])[0]
    if arch not in DEEPSEEK_MOE_ARCHITECTURES:
        raise ValueError(f"{arch!r} is not a DeepSeek MoE architecture ({', '.join(DEEPSEEK_MOE_ARCHITECTURES)})")
    v2 = arch == "DeepseekV2ForCausalLM"
    cfg = {**HF_DEFAULTS[arch], **{key: value for key, value in cfg.items() if value is not None}}
    if v2 and cfg["topk_method"] == "group_limited_greedy" and not ("n_group" in cfg and "topk_group" in cfg):
        raise ValueError("topk_method='group_limited_greedy' needs n_group and topk_group in config.json")
    # V3 and GLM-4.7-Flash always route by noaux_tc on sigmoid scores (transformers reads neither topk_method nor
    # scoring_func there); V2 ranks softmax probabilities by its topk_method
    routing = DeepseekRouting(
        scoring_func="softmax" if v2 else "sigmoid",
        topk_method=cfg["topk_method"] if v2 else "noaux_tc",
        n_group=cfg.get("n_group", 1), topk_group=cfg.get("topk_group", 1),
        routed_scaling_factor=float(cfg["routed_scaling_factor"]), n_shared_experts=cfg["n_shared_experts"],
    )
    width = cfg["moe_intermediate_size"]
    return MoEConfig(
        num_experts=cfg["n_routed_experts"], top_k=cfg["num_experts_per_tok"], intermediate_size=width,
        # transformers' V2 router never renormalises (its norm_topk_prob is unused); V3 / GLM do when asked
        norm_topk_prob=False if v2 else bool(cfg["norm_topk_prob"]),
        shared_expert_intermediate_size=routing.n_shared_experts * width,
        mlp_only_layers=dense_layers(cfg, arch, cfg["num_hidden_layers"]),
        deepseek_router=routing,
    )


ALWAYS_INTERLEAVED = ("DeepseekV2ForCausalLM", "DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM")
"""Families whose MLA rotary pairs are interleaved whatever config.json's rope_interleave says."""


@dataclass(kw_only=True, frozen=True, slots=True)
class MLAConfig:
    """Multi-head latent attention's shapes (DeepSeek-V2/V3, Kimi-K2, GLM-4.7-Flash), from config.json."""

    kv_lora_rank: int
    """Width of the compressed KV every head shares (r): the cached latent holds it after its RMSNorm."""
    qk_rope_head_dim: int
    """Width of the rotated key part, one for all heads (cached beside the compressed KV) and of each query's."""
    qk_nope_head_dim: int
    """Width of each head's key and query part without rotary (the keys' comes from the latent's up-projection)."""
    v_head_dim: int
    """Width of each head's value (may differ from qk_nope_head_dim + qk_rope_head_dim)."""
    q_lora_rank: int | None = None
    """Queries through a low-rank projection of this width and its RMSNorm (q_a_proj, q_a_layernorm, q_b_proj);
    None: one q_proj."""
    rope_interleave: bool = True
    """The rotary dimensions pair as (0, 1), (2, 3), ... (DeepSeek's layout; V2 always) rather than (i, i + d/2)."""
    rotary: bool = True
    """The rope part of queries and keys is rotated by position; False: it is used as projected (Kimi Linear's MLA
    layers, which carry no position: cpllm/config/kimi_linear.py)."""

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_width(self) -> int:
        """Values cached per token and layer: kv_lora_rank + qk_rope_head_dim (576 for DeepSeek-V3)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even (rotary pairs)")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ValueError(f"q_lora_rank={self.q_lora_rank} must be >= 1 or null")

    def softmax_scale(self, rope_scaling: dict[str, Any] | None) -> float:
        """qk_head_dim ** -0.5, times yarn_mscale(factor, mscale_all_dim) ** 2 under a scaled rotary with
        mscale_all_dim set (DeepSeek's YaRN correction, as transformers applies it)."""
        from cpllm.config.rope import yarn_mscale

        scale = self.qk_head_dim**-0.5
        kind = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
        if kind != "default" and rope_scaling.get("mscale_all_dim"):
            mscale = yarn_mscale(rope_scaling["factor"], rope_scaling["mscale_all_dim"])
            scale *= mscale * mscale
        return scale

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "MLAConfig":
        arch = (cfg.get("architectures") or [""])[0]
        return cls(kv_lora_rank=cfg["kv_lora_rank"], qk_rope_head_dim=cfg["qk_rope_head_dim"],
                   qk_nope_head_dim=cfg["qk_nope_head_dim"], v_head_dim=cfg["v_head_dim"],
                   q_lora_rank=cfg.get("q_lora_rank"),
                   # transformers' V2, V3.2 and GLM-5 always rotate interleaved pairs; V3 / GLM-4.7 as configured
                   rope_interleave=True if arch in ALWAYS_INTERLEAVED else cfg.get("rope_interleave", True))


def latent_cache_line(mla: MLAConfig, num_layers: int, rank_bytes: int, rank_slots: int, shard_ranks: int,
                      capacity_tokens: int, *, indexer=None) -> str:
    """The start-up log's line on an MLA model's latent cache, from what one rank allocated: `rank_bytes` over
    `rank_slots` token slots per layer pool, each request divided over `shard_ranks` ranks (PCP x DCP, or DCP
    under the replicated layout), the replica holding `capacity_tokens` tokens. Every TP rank holds the same
    latents without DCP; with DCP = N each holds 1/N of each request, so N times the tokens fit the same bytes.
    A sparse-attention model (`indexer`, cpllm/config/sparse_mla.py) also keeps an index key beside each row."""
    stored = rank_bytes // max(rank_slots, 1)
    index = "" if indexer is None else f" and an index key of {indexer.index_head_dim} values"
    return (f"latent cache (MLA): one row of {mla.latent_width} values (kv_lora_rank {mla.kv_lora_rank} + rope "
            f"{mla.qk_rope_head_dim}){index} per token and layer, {num_layers} layers: {stored} bytes per token stored on "
            f"a rank; each request is divided over {shard_ranks} rank(s), so {stored / shard_ranks:.0f} bytes per "
            f"token of a request per rank, and the replica holds {capacity_tokens} tokens")
