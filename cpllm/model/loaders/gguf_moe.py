"""GGUF mixture-of-experts models: their config and their tensor names, mapped onto Hugging Face's.

llama.cpp stores a sparse layer's experts stacked, one tensor per projection (`blk.N.ffn_gate_exps.weight`,
[E, out, in] in torch order), where a Hugging Face checkpoint has one tensor per expert. The GGUF source offers
every expert under its per-expert HF name, as a view of its slice of the stack, so the model asks for the same
names whatever the file format. The converter's --fuse-gate-up-exps writes gate and up as one stack
(`ffn_gate_up_exps`, [E, 2 I, in], each expert's gate rows first): each expert's gate and up are views of its
halves. Mixtral is a llama file with an expert count; its HF names differ
(`block_sparse_moe`, w1 / w3 / w2).
"""

from __future__ import annotations

import re
from typing import Any, Callable

from cpllm.config.moe import MoEConfig

GGUF_MOE_ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM",
                          "qwen2moe": "Qwen2MoeForCausalLM"}
"""GGUF architectures added for issue 11 -> HF architecture (llama + expert_count is Mixtral)."""

NORM_TOPK_DEFAULT = {"qwen3moe": True, "qwen2moe": False, "llama": True}
"""Whether the router renormalises its top-k weights when the file does not say (expert_weights_norm):
what llama.cpp assumes for each architecture."""

_QWEN_NAMES = {"ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
               "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
               "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
               "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
               "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}
_STACKED = {"ffn_gate_exps.weight": 0, "ffn_up_exps.weight": 1, "ffn_down_exps.weight": 2}
"""Stacked expert tensor -> index into MoEConfig.expert_weight_names (gate, up, down)."""
_GATE_UP_STACK = "ffn_gate_up_exps.weight"
"""gate and up of every expert in one stack, [E, 2 I, in], gate rows first."""
ExpertIndex = int | tuple[int, slice] | None
"""Where an HF tensor lies in its stored one: None (all of it), an expert of a stack, or rows of an expert."""
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")
_PER_EXPERT_RE = re.compile(r"ffn_(gate|up|down)\.(\d+)\.weight")
"""Older Mixtral files: one tensor per expert, `blk.N.ffn_gate.E.weight`."""


def hf_architecture(arch: str, meta: Callable[[str, Any], Any]) -> str | None:
    """HF architecture of a GGUF architecture this module handles (None: not a MoE / Qwen3 file)."""
    if arch == "llama" and meta("llama.expert_count", None):
        return "MixtralForCausalLM"
    return GGUF_MOE_ARCHITECTURES.get(arch)


def gguf_moe_config(arch: str, meta: Callable[[str, Any], Any], tensor_names: set[str],
                    num_layers: int) -> MoEConfig | None:
    """The MoE part of the config from GGUF metadata; sparse layers are the ones holding a router."""
    experts = meta(f"{arch}.expert_count", None)
    if not experts:
        return None
    mixtral = arch == "llama"
    dense = tuple(i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names)
    width = meta(f"{arch}.expert_feed_forward_length", None) or meta(f"{arch}.feed_forward_length", None)
    return MoEConfig(
        num_experts=int(experts), top_k=int(meta(f"{arch}.expert_used_count", None)), intermediate_size=int(width),
        norm_topk_prob=bool(meta(f"{arch}.expert_weights_norm", NORM_TOPK_DEFAULT.get(arch, False))),
        shared_expert_intermediate_size=int(meta(f"{arch}.expert_shared_feed_forward_length", 0) or 0),
        mlp_only_layers=dense,
        expert_prefix="block_sparse_moe" if mixtral else "mlp",
        expert_weight_names=("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj"),
    )


def moe_hf_names(gguf_name: str, moe: MoEConfig | None) -> list[tuple[str, ExpertIndex]]:
    """(HF name, its index into the stored tensor: None, an expert of the stack, or (expert, its rows)) for a GGUF
    tensor this module maps; [] when it maps none."""
    match = _LAYER_RE.fullmatch(gguf_name)
    if match is None:
        return []
    layer, rest = f"model.layers.{match.group(1)}", match.group(2)
    if rest in _QWEN_NAMES:
        return [(f"{layer}.{_QWEN_NAMES[rest]}", None)]
    if moe is None:
        return []
    if rest == "ffn_gate_inp.weight":
        return [(f"{layer}.{moe.expert_prefix}.gate.weight", None)]
    if rest in _STACKED:
        proj = moe.expert_weight_names[_STACKED[rest]]
        return [(f"{layer}.{moe.expert_prefix}.experts.{e}.{proj}.weight", e) for e in range(moe.num_experts)]
    if rest == _GATE_UP_STACK:
        rows, (gate, up, _) = moe.intermediate_size, moe.expert_weight_names
        return [(f"{layer}.{moe.expert_prefix}.experts.{e}.{proj}.weight", (e, slice(lo, lo + rows)))
                for e in range(moe.num_experts) for proj, lo in ((gate, 0), (up, rows))]
    single = _PER_EXPERT_RE.fullmatch(rest)
    if single is not None:
        proj = moe.expert_weight_names[("gate", "up", "down").index(single.group(1))]
        return [(f"{layer}.{moe.expert_prefix}.experts.{single.group(2)}.{proj}.weight", None)]
    return []
