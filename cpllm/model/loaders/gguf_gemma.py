"""Gemma 2 / Gemma 3 in llama.cpp's GGUF files (architectures "gemma2", "gemma3"): their tensor names, their
norm weights, and the ModelConfig fields llama.cpp stores or decides itself (cpllm/model/loaders/gguf_source.py asks here).

What differs from a Hugging Face Gemma checkpoint:
- names: the four norms of a layer are `attn_norm` (input), `post_attention_norm`, `ffn_norm` (before the MLP, not
  after attention as in Llama) and `post_ffw_norm`; Gemma 3's q/k norms are `attn_q_norm` / `attn_k_norm`;
- norm weights: llama.cpp's converter stores every Gemma RMSNorm weight as 1 + w (its norm multiplies by the
  weight), so reading subtracts 1. For |w| <= 1/2 that is exact (Sterbenz), and the model adds the 1 back as
  transformers does, getting transformers' factor bit for bit;
- what no key holds, as llama.cpp decides it: the score scale is head_dim ** -0.5 except for the 27B models
  (46 layers Gemma 2, 62 layers Gemma 3: (hidden / heads) ** -0.5); the sliding layers are every second one (Gemma
  2) or five of six (Gemma 3) unless `attention.sliding_window_pattern` says; Gemma 3's sliding layers rotate with
  base 10000 unless `rope.freq_base_swa` says, unscaled.
"""

from __future__ import annotations

from typing import Any, Callable

GEMMA_GGUF_ARCHITECTURES = {"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
"""GGUF `general.architecture` -> Hugging Face architecture, for the Gemma families."""

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
_LAYERS_27B = {"gemma2": 46, "gemma3": 62}
"""Layer counts llama.cpp reads as the 27B models, whose score scale is (hidden / heads) ** -0.5."""
_SWA_PATTERN = {"gemma2": 2, "gemma3": 6}


def gemma_layer_name(rest: str) -> str | None:
    """The HF name (after `model.layers.N.`) of a Gemma layer tensor whose name differs from Llama's, or None."""
    return _LAYER_NAMES.get(rest)


def stores_one_plus_w(hf_name: str) -> bool:
    """Whether llama.cpp stored this tensor as 1 + w (every Gemma RMSNorm weight)."""
    return hf_name.endswith("norm.weight")


def _layer_types(pattern: Any, layers: int) -> tuple[str, ...]:
    """llama.cpp's pattern: n -> layer i slides iff i % n < n - 1; a list of bools -> layer i slides iff True."""
    if isinstance(pattern, (list, tuple)):
        slides = [bool(p) for p in pattern]
    else:
        slides = [int(pattern) == 0 or i % int(pattern) < int(pattern) - 1 for i in range(layers)]
    return tuple("sliding_attention" if s else "full_attention" for s in slides)


def gemma_gguf_fields(arch: str, meta: Callable[[str, Any], Any], layers: int, hidden: int, heads: int,
                      head_dim: int) -> dict[str, Any]:
    """The ModelConfig fields of a Gemma GGUF file ({} for other architectures)."""
    if arch not in GEMMA_GGUF_ARCHITECTURES:
        return {}
    window = meta(f"{arch}.attention.sliding_window", None)
    pattern = meta(f"{arch}.attention.sliding_window_pattern", _SWA_PATTERN[arch])
    fields: dict[str, Any] = dict(
        sliding_window=None if window is None else int(window),
        layer_types=() if window is None else _layer_types(pattern, layers),
        query_pre_attn_scalar=hidden // heads if layers == _LAYERS_27B[arch] else head_dim,
        # llama.cpp's defaults where Gemma 2's keys are absent: 30 and 50
        final_logit_softcapping=meta(f"{arch}.final_logit_softcapping", 30.0 if arch == "gemma2" else None),
        attn_logit_softcapping=meta(f"{arch}.attn_logit_softcapping", 50.0) if arch == "gemma2" else None,
        hidden_activation="gelu_pytorch_tanh",
    )
    if arch == "gemma3":
        fields["rope_local_theta"] = float(meta(f"{arch}.rope.freq_base_swa", 10000.0))
    return fields
