"""Kimi Linear (KimiLinearForCausalLM) read from config.json (no I/O, no torch): Kimi delta attention layers
interleaved with MLA layers that rotate nothing, on the DeepSeek-V3 mixture of experts.

A Kimi delta attention (KDA) layer keeps a fixed-size state per request, as a gated DeltaNet layer does, but its
decay is per key channel rather than per head: cpllm/layers/kimi_delta/. The full layers are MLA
(cpllm/layers/mla/) with `MLAConfig.rotary` off; the sparse layers are DeepSeek MoE blocks (sigmoid router with
the correction bias over expert groups, shared experts) stored under `block_sparse_moe` with Mixtral's expert
names. config.json spells several fields its own way (transformers' attribute_map: num_experts,
num_experts_per_token, num_expert_group, moe_renormalize, num_shared_experts, model_max_length) and the original
checkpoints keep the layer pattern in `linear_attn_config` (1-indexed kda_layers / full_attn_layers); both are read.
What transformers 5.24 computes is the reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cpllm.config.deepseek import MLAConfig
from cpllm.config.moe import MoEConfig
from cpllm.config.routing import DeepseekRouting

KIMI_LINEAR_ARCHITECTURES = ("KimiLinearForCausalLM",)
"""Hugging Face architectures built as Kimi Linear (cpllm/model/families/kimi_linear.py)."""
HF_NAMES = {"n_routed_experts": ("num_experts", "num_local_experts"),
            "num_experts_per_tok": ("num_experts_per_token",), "n_group": ("num_expert_group",),
            "norm_topk_prob": ("moe_renormalize",), "n_shared_experts": ("num_shared_experts",),
            "max_position_embeddings": ("model_max_length",)}
"""cpllm's (DeepSeek's) key -> the keys a Kimi Linear config.json may carry instead, in order of preference."""
HF_DEFAULTS = dict(n_routed_experts=256, num_experts_per_tok=8, n_group=1, topk_group=1, norm_topk_prob=True,
                   n_shared_experts=1, routed_scaling_factor=2.446, first_k_dense_replace=1,
                   max_position_embeddings=1048576)
"""transformers 5.24's KimiLinearConfig defaults, for a field config.json leaves out."""


@dataclass(kw_only=True, frozen=True, slots=True)
class KimiDeltaConfig:
    """The Kimi delta attention layers' shapes and which layers they are."""

    linear_layers: tuple[int, ...]
    """Indices of the KDA layers (layer_types 'linear_attention'); the others are MLA."""
    num_heads: int
    """Heads of a KDA layer (linear_num_heads): q, k and v alike, one delta-rule matrix per head."""
    head_dim: int
    """Width of every q, k and v head (linear_head_dim), and of the forget and output gates' low rank."""
    conv_kernel: int
    """Taps of the causal depthwise convolution over q|k|v (linear_conv_kernel_dim): its state is the last
    conv_kernel - 1 inputs."""
    norm_eps: float
    """Epsilon of the gated output norm (the model's rms_norm_eps)."""

    def __post_init__(self) -> None:
        for name in ("num_heads", "head_dim", "conv_kernel"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")

    @property
    def qkv_dim(self) -> int:
        """Width of each of q, k and v: num_heads x head_dim."""
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: q, k and v of every head."""
        return 3 * self.qkv_dim

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "KimiDeltaConfig":
        sub = cfg.get("linear_attn_config") or {}
        types = kimi_layer_types(cfg)
        return cls(linear_layers=tuple(i for i, kind in enumerate(types) if kind == "linear_attention"),
                   num_heads=sub.get("num_heads", cfg.get("linear_num_heads", 32)),
                   head_dim=sub.get("head_dim", cfg.get("linear_head_dim", 128)),
                   conv_kernel=sub.get("short_conv_kernel_size", cfg.get("linear_conv_kernel_dim", 4)),
                   norm_eps=cfg.get("rms_norm_eps", 1e-5))


def kimi_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json with DeepSeek's keys filled from Kimi's spellings (HF_NAMES) and transformers' defaults."""
    out = dict(cfg)
    for key, spellings in HF_NAMES.items():
        if out.get(key) is None:
            out[key] = next((cfg[s] for s in spellings if cfg.get(s) is not None), HF_DEFAULTS[key])
    for key, value in HF_DEFAULTS.items():
        if out.get(key) is None:
            out[key] = value
    return out


def kimi_layer_types(cfg: dict[str, Any]) -> list[str]:
    """Each layer's 'linear_attention' (KDA) or 'full_attention' (MLA): layer_types, else linear_attn_config's
    1-indexed lists, else transformers' default (every fourth layer from layer 4 full)."""
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    sub = cfg.get("linear_attn_config") or {}
    if types is None and "full_attn_layers" in sub and "kda_layers" in sub:
        types = [None] * n
        for kind, key in (("full_attention", "full_attn_layers"), ("linear_attention", "kda_layers")):
            for layer in sub[key]:
                if not 1 <= layer <= n:
                    raise ValueError(f"linear_attn_config.{key} names layer {layer}; layers are 1..{n}")
                types[layer - 1] = kind
    if types is None:
        types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]
    if len(types) != n or set(types) - {"linear_attention", "full_attention"}:
        raise ValueError(f"layer_types={types} must name 'linear_attention' or 'full_attention' for each of "
                         f"{n} layers")
    if "full_attention" not in types:
        raise ValueError("a Kimi Linear model with no full_attention layer is not built (layer_types has none)")
    return list(types)


def kimi_mla_config(cfg: dict[str, Any]) -> MLAConfig:
    """The MLA layers' shapes: DeepSeek's, with nothing rotated (transformers' KimiLinearAttention applies no
    rotary: its keys' rope part is shared by the heads but carries no position)."""
    return MLAConfig(kv_lora_rank=cfg["kv_lora_rank"], qk_rope_head_dim=cfg["qk_rope_head_dim"],
                     qk_nope_head_dim=cfg["qk_nope_head_dim"], v_head_dim=cfg["v_head_dim"],
                     q_lora_rank=cfg.get("q_lora_rank"), rotary=False)


def kimi_moe_config(cfg: dict[str, Any]) -> MoEConfig:
    """The MoE part (cfg already through `kimi_fields`): transformers routes by sigmoid scores plus the correction
    bias over expert groups whatever config.json's moe_router_activation_func says; the dense layers are
    mlp_layer_types' 'dense' ones, else the first first_k_dense_replace."""
    n = cfg["num_hidden_layers"]
    types = cfg.get("mlp_layer_types") or ["dense" if i < cfg["first_k_dense_replace"] else "sparse"
                                           for i in range(n)]
    if len(types) != n or set(types) - {"dense", "sparse"}:
        raise ValueError(f"mlp_layer_types={types} must name 'dense' or 'sparse' for each of {n} layers")
    routing = DeepseekRouting(scoring_func="sigmoid", topk_method="noaux_tc", n_group=cfg["n_group"],
                              topk_group=cfg.get("topk_group") or 1,
                              routed_scaling_factor=float(cfg["routed_scaling_factor"]),
                              n_shared_experts=cfg["n_shared_experts"])
    width = cfg["moe_intermediate_size"]
    return MoEConfig(num_experts=cfg["n_routed_experts"], top_k=cfg["num_experts_per_tok"], intermediate_size=width,
                     norm_topk_prob=bool(cfg["norm_topk_prob"]),
                     shared_expert_intermediate_size=routing.n_shared_experts * width,
                     mlp_only_layers=tuple(i for i, kind in enumerate(types) if kind == "dense"),
                     expert_prefix="block_sparse_moe", expert_weight_names=("w1", "w3", "w2"),
                     deepseek_router=routing)


def check_kimi_options(*, speculative: bool, compile_decode: bool, tp: int, pcp: int, kda: KimiDeltaConfig) -> None:
    """Refuse, naming the option, what Kimi Linear does not run yet (never a silent wrong answer). As on the gated
    DeltaNet hybrids (cpllm/config/linear_attention.py `check_hybrid_options`), prefix caching runs from the
    kind-free state snapshots (cpllm/engine/state_snapshots.py) and speculative decoding keeps the states through
    a verify chunk's known tokens only (cpllm/layers/kimi_delta/layer.py); a draft model with states is refused
    where every draft model is read (cpllm/engine/draft_model.py)."""
    if speculative and pcp > 1:
        raise ValueError(f"speculative_config with Kimi Linear under prefill_context_parallel_size={pcp}: a verify "
                         "chunk split over PCP ranks would need the state scan to stop before its drafts, which is "
                         "not built; run speculative decoding with PCP = 1 (TP and DCP run it)")
    if compile_decode:
        raise ValueError("compile_decode=True with Kimi Linear: its state layers run eager only")
    if kda.num_heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide linear_num_heads={kda.num_heads} (each rank "
                         "holds whole heads of every Kimi delta attention layer)")
