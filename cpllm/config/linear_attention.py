"""Linear-attention hybrids (Qwen3.5 dense and MoE, Qwen3-Next): gated DeltaNet layers interleaved with gated
full-attention layers, read from config.json (no I/O, no torch).

A gated DeltaNet layer keeps a fixed-size state per request (a short causal convolution's window and one delta-rule
matrix per value head) instead of K/V rows: cpllm/layers/gated_delta/. The full-attention layers are GQA layers
with an output gate, per-head q/k norms and rotary on part of each head (cpllm/model/families/qwen3_5.py).
What transformers 5.24 computes is the reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

HYBRID_ARCHITECTURES = ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM")
"""Hugging Face architectures built as gated-DeltaNet hybrids (cpllm/model/families/qwen3_5.py)."""
HYBRID_MOE_ARCHITECTURES = ("Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM")
"""The hybrids whose MLPs are Qwen mixtures of experts with a sigmoid-gated shared expert (cpllm/config/moe.py)."""
FUSED_PROJECTIONS = ("Qwen3NextForCausalLM",)
"""Architectures storing the DeltaNet input projections fused per key head (in_proj_qkvz, in_proj_ba) rather than
as separate in_proj_qkv / in_proj_z / in_proj_b / in_proj_a tensors."""


@dataclass(kw_only=True, frozen=True, slots=True)
class LinearAttentionConfig:
    """The gated DeltaNet layers' shapes and which layers they are."""

    linear_layers: tuple[int, ...]
    """Indices of the gated DeltaNet layers (config.json's layer_types 'linear_attention'); the others are full
    attention."""
    num_key_heads: int
    """Query/key heads of a DeltaNet layer (linear_num_key_heads)."""
    num_value_heads: int
    """Value heads (linear_num_value_heads), a multiple of num_key_heads: each key head serves
    num_value_heads / num_key_heads consecutive value heads; one delta-rule matrix per value head."""
    key_head_dim: int
    """Width of a query/key head (linear_key_head_dim)."""
    value_head_dim: int
    """Width of a value head (linear_value_head_dim)."""
    conv_kernel: int
    """Taps of the causal depthwise convolution over q|k|v (linear_conv_kernel_dim): its state is the last
    conv_kernel - 1 inputs."""
    rotary_dim: int
    """Width of each full-attention head that rotary turns (head_dim x partial_rotary_factor)."""
    fused_projections: bool = False
    """The input projections are stored fused per key head (Qwen3-Next: in_proj_qkvz, in_proj_ba)."""

    def __post_init__(self) -> None:
        for name in ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim", "conv_kernel",
                     "rotary_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(f"linear_num_value_heads={self.num_value_heads} must be a multiple of "
                             f"linear_num_key_heads={self.num_key_heads}")
        if self.rotary_dim % 2:
            raise ValueError(f"rotary width {self.rotary_dim} (head_dim x partial_rotary_factor) must be even")

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: q, k and v of every head."""
        return 2 * self.key_dim + self.value_dim

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "LinearAttentionConfig":
        arch = (cfg.get("architectures") or [""])[0]
        num_layers = cfg["num_hidden_layers"]
        types = cfg.get("layer_types")
        if types is None:  # transformers' default: every full_attention_interval-th layer is full attention
            interval = cfg.get("full_attention_interval", 4)
            types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]
        if len(types) != num_layers or set(types) - {"linear_attention", "full_attention"}:
            raise ValueError(f"layer_types={types} must name 'linear_attention' or 'full_attention' for each of "
                             f"{num_layers} layers")
        if "full_attention" not in types:
            raise ValueError("a hybrid with no full_attention layer is not built (layer_types has none)")
        params = cfg.get("rope_parameters") or {}
        factor = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        return cls(
            linear_layers=tuple(i for i, kind in enumerate(types) if kind == "linear_attention"),
            num_key_heads=cfg["linear_num_key_heads"], num_value_heads=cfg["linear_num_value_heads"],
            key_head_dim=cfg["linear_key_head_dim"], value_head_dim=cfg["linear_value_head_dim"],
            conv_kernel=cfg["linear_conv_kernel_dim"], rotary_dim=int(head_dim * factor),
            fused_projections=arch in FUSED_PROJECTIONS,
        )


def check_hybrid_options(*, speculative: bool, compile_decode: bool, tp: int, pcp: int,
                         linear: LinearAttentionConfig) -> None:
    """Refuse, naming the option, what the hybrids do not run yet (never a silent wrong answer). PCP runs: a prompt
    chunk split over PCP ranks goes through the state scan (cpllm/layers/gated_delta/pcp_prefill.py), with every
    prefill strategy and KV layout of the full layers. Prefix caching runs from state snapshots at block
    boundaries (cpllm/engine/state_snapshots.py), speculative decoding keeps the states through a verify chunk's
    known tokens only (cpllm/engine/scheduler.py `_drafts`)."""
    if speculative and pcp > 1:
        raise ValueError(f"speculative_config with a linear-attention hybrid under "
                         f"prefill_context_parallel_size={pcp}: a verify chunk split over PCP ranks would need the state scan to stop before its drafts, "
                         "which is not built; run speculative decoding with PCP = 1 (TP and DCP run it)")
    if compile_decode:
        raise ValueError("compile_decode=True with a linear-attention hybrid: its state layers run eager only")
    if linear.num_key_heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide linear_num_key_heads={linear.num_key_heads} "
                         "(each rank holds whole key heads of every gated DeltaNet layer)")
