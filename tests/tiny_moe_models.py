"""Tiny random Qwen3 / Qwen3-MoE / Qwen2-MoE / Mixtral models for tests (built with transformers, nothing downloaded).

Same vocabulary, tokenizer and attention sharpening as tests/tiny_models.py. Routing is sharpened too: the
router weights are scaled by ROUTER_SCALE, so each token's top-k experts win by clear margins and fp32 rounding
differences between implementations (or between parallel layouts) never flip a choice.

Shapes: hidden 64, 4 query heads and 2 KV heads of width 16, 2 layers, 8 experts of width 32 (top-2); Qwen2-MoE
adds a shared expert of width 64 and Qwen3-MoE keeps layer 1 dense (mlp_only_layers) so both kinds of layer run.
Expert width 32 splits over 4 ranks (expert-TP) and 8 experts over 4 ranks (EP).

`save_tiny_moe_gguf` writes the same weights as llama.cpp's converter lays out a MoE model: the experts of a
layer stacked into one tensor per projection (`blk.N.ffn_{gate,up,down}_exps.weight`, [E, out, in] in torch
order), the router as `ffn_gate_inp`, the shared expert as `ffn_*_shexp` with its gate `ffn_gate_inp_shexp`.
"""

from __future__ import annotations

import os
from typing import Any

import gguf
import numpy as np
import torch
from gguf.quants import quantize

from tiny_models import (_add_metadata, gguf_tensor_name, llama_cpp_permute, randomize_weights, tiny_hf_tokenizer,
                         tiny_vocab)

ROUTER_SCALE = 40.0
"""Factor on the random router weights: logits of std ~5 instead of ~0.15, so top-k choices are stable."""
FAMILIES = ("qwen3", "qwen3_moe", "qwen2_moe", "mixtral")
GGUF_ARCH = {"qwen3": "qwen3", "qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama"}
"""llama.cpp's architecture name per family (Mixtral is a llama with expert_count)."""


def tiny_moe_config(family: str, **overrides: Any):
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig

    vocab = tiny_vocab()
    fields: dict[str, Any] = dict(
        vocab_size=len(vocab.tokens), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=50000.0,
        tie_word_embeddings=False, bos_token_id=vocab.bos_token_id, eos_token_id=vocab.eos_token_id,
        pad_token_id=vocab.pad_token_id,
    )  # fmt: skip
    moe = dict(num_experts_per_tok=2)
    if family == "qwen3":
        fields.update(intermediate_size=128)
    elif family == "qwen3_moe":
        fields.update(moe, intermediate_size=96, moe_intermediate_size=32, num_experts=8, norm_topk_prob=True,
                      mlp_only_layers=[1])
    elif family == "qwen2_moe":
        fields.update(moe, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                      shared_expert_intermediate_size=64)
    elif family == "mixtral":
        fields.update(moe, intermediate_size=32, num_local_experts=8)
    else:
        raise ValueError(f"unknown family {family!r}; choose one of {FAMILIES}")
    fields.update(overrides)
    classes = {"qwen3": Qwen3Config, "qwen3_moe": Qwen3MoeConfig, "qwen2_moe": Qwen2MoeConfig,
               "mixtral": MixtralConfig}
    return classes[family](**fields)


def make_tiny_moe_model(family: str, *, seed: int = 0, **overrides: Any):
    """A random transformers model of `family` (float32, eval), norms and biases randomized, attention and
    routing sharpened."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_moe_config(family, **overrides), dtype=torch.float32)
    return randomize_weights(model, seed, _randomize_experts_and_router)


def _randomize_experts_and_router(name: str, param: torch.Tensor, generator: torch.Generator) -> None:
    if ".experts." in name or name.endswith(("experts.gate_up_proj", "experts.down_proj")):
        param.copy_(0.05 * torch.randn(param.shape, generator=generator))  # HF leaves them unset
    if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
        param.copy_(0.02 * ROUTER_SCALE * torch.randn(param.shape, generator=generator))


def save_tiny_moe_model(folder: str, family: str, *, seed: int = 0, **overrides: Any) -> str:
    """The model as a Hugging Face folder (one tensor per expert, as save_pretrained writes it) + tokenizer."""
    os.makedirs(folder, exist_ok=True)
    make_tiny_moe_model(family, seed=seed, **overrides).save_pretrained(folder)
    tiny_hf_tokenizer().save_pretrained(folder)
    return folder


def hf_state_dict(folder: str) -> dict[str, torch.Tensor]:
    """Every tensor of a saved folder under its checkpoint name (per-expert names)."""
    from safetensors.torch import load_file

    return load_file(os.path.join(folder, "model.safetensors"))


_MOE_GGUF = {"gate": "ffn_gate_inp", "shared_expert_gate": "ffn_gate_inp_shexp",
             "shared_expert.gate_proj": "ffn_gate_shexp", "shared_expert.up_proj": "ffn_up_shexp",
             "shared_expert.down_proj": "ffn_down_shexp"}
_EXPERT_GGUF = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
                "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}


def _gguf_name(hf_name: str) -> str:
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    if module in ("self_attn.q_norm", "self_attn.k_norm"):
        return f"blk.{layer}.attn_{module[-6]}_norm.{kind}"
    sub = module.split(".", 1)[1] if module.startswith(("mlp.", "block_sparse_moe.")) else None
    if sub in _MOE_GGUF:
        return f"blk.{layer}.{_MOE_GGUF[sub]}.{kind}"
    return gguf_tensor_name(hf_name)


def save_tiny_moe_gguf(path: str, folder: str, family: str, *, stacked: bool = True,
                       expert_type: gguf.GGMLQuantizationType | None = None, **overrides: Any) -> None:
    """Write the saved folder's weights (F32) as a llama.cpp-style GGUF with stacked expert tensors (or, with
    `stacked=False`, one `blk.N.ffn_gate.E.weight` per expert as older Mixtral files do), the stacks quantized to
    `expert_type` when given; `overrides` are the ones the folder's model was built with."""
    config = tiny_moe_config(family, **overrides)
    state = hf_state_dict(folder)
    writer = gguf.GGUFWriter(path, GGUF_ARCH[family])
    _add_metadata(writer, config, tiny_vocab())
    arch = GGUF_ARCH[family]
    if family != "qwen3":
        experts = getattr(config, "num_experts", None) or config.num_local_experts
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
    if family in ("qwen3_moe", "qwen2_moe"):
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if family == "qwen2_moe":
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    experts_of: dict[str, dict[int, np.ndarray]] = {}
    for name, tensor in state.items():
        weight = tensor.to(torch.float32).numpy()
        parts = name.split(".")
        if "experts" in parts and parts[parts.index("experts") + 1].isdigit():
            i = parts.index("experts")
            gname = f"blk.{parts[2]}.{_EXPERT_GGUF[parts[i + 2]]}.weight"
            if stacked:
                experts_of.setdefault(gname, {})[int(parts[i + 1])] = weight
            else:
                writer.add_tensor(gname.replace("_exps.", f".{parts[i + 1]}."), weight)
            continue
        heads = {"self_attn.q_proj.weight": config.num_attention_heads,
                 "self_attn.k_proj.weight": config.num_key_value_heads}
        key = ".".join(parts[3:])
        if arch == "llama" and key in heads:
            weight = llama_cpp_permute(weight, heads[key])
        writer.add_tensor("output.weight" if name == "lm_head.weight" else _gguf_name(name)
                          if name.startswith("model.layers.") else gguf_tensor_name(name), weight)
    for gname, per_expert in experts_of.items():
        stack = np.stack([per_expert[e] for e in sorted(per_expert)])
        if expert_type is None:
            writer.add_tensor(gname, stack)
        else:  # blocks run along the last (input) axis, so each expert's rows quantize on their own
            writer.add_tensor(gname, quantize(stack, expert_type), raw_dtype=expert_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
