"""Per-layer attention kinds (full or sliding window) and the Gemma attention fields, read from a Hugging Face
config.json (no torch). ModelConfig (config/engine.py) holds the values; this module reads and checks them.

A layer's kind is "full_attention" or "sliding_attention" (transformers' `layer_types` spelling). A sliding layer
of window W lets query position i see key position j iff i - W < j <= i. Which layers slide, per family, as
transformers 5 decides it:
- Mistral and Mixtral: every layer, when `sliding_window` is set (no `layer_types`);
- Qwen2 and Qwen3: `layer_types` where the config has it, else layers i >= `max_window_layers`; none unless
  `use_sliding_window` is true (its configs carry a `sliding_window` value either way);
- Qwen3-MoE: every layer when `use_sliding_window` is true (transformers reads neither `layer_types` nor
  `max_window_layers` for it);
- Gemma2 / Gemma3: `layer_types`, else every second layer slides (Gemma2: even i) or all but every
  `sliding_window_pattern`-th (Gemma3, default 6: layers 5, 11, ... are full).
"""

from __future__ import annotations

from typing import Any

FULL, SLIDING = "full_attention", "sliding_attention"
"""The two attention kinds of ModelConfig.layer_types (config.LAYER_TYPES)."""
WINDOWED_ARCHITECTURES = ("MistralForCausalLM", "MixtralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                          "Qwen3MoeForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "GptOssForCausalLM")
"""Families whose sliding windows cpllm runs; a window in effect in another family's config is refused."""
GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
"""The Gemma text families (cpllm/model/families/gemma.py)."""
GEMMA_DEFAULTS = {
    "Gemma2ForCausalLM": dict(sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
    "Gemma3ForCausalLM": dict(sliding_window=4096, attn_logit_softcapping=None, final_logit_softcapping=None),
}
"""transformers 5's values of the keys a Gemma config.json may leave out (Gemma2Config, Gemma3TextConfig)."""
GEMMA_ACTIVATIONS = ("gelu_pytorch_tanh",)
"""MLP activations of the Gemma families cpllm runs (GeGLU with the tanh approximation of GELU)."""
_USE_SLIDING_WINDOW = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
"""Families whose window is off unless `use_sliding_window` is true (transformers' default for them: false)."""
_ALL_LAYERS = ("MistralForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM")
"""Families whose window, when set, applies to every layer (no `layer_types`)."""


def _default_layer_types(arch: str, cfg: dict[str, Any], sliding: int | None, layers: int) -> list[str]:
    if sliding is None:
        return [FULL] * layers
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        first = cfg.get("max_window_layers")
        first = 28 if first is None else first  # transformers' Qwen2Config / Qwen3Config default
        return [SLIDING if i >= first else FULL for i in range(layers)]
    if arch in ("Gemma2ForCausalLM", "GptOssForCausalLM"):
        return [SLIDING if (i + 1) % 2 else FULL for i in range(layers)]
    if arch == "Gemma3ForCausalLM":
        pattern = cfg.get("sliding_window_pattern") or 6
        return [SLIDING if (i + 1) % pattern else FULL for i in range(layers)]
    return [SLIDING] * layers  # Mistral, Mixtral, Qwen3-MoE: one window for every layer


def hf_layer_types(arch: str, cfg: dict[str, Any]) -> tuple[int | None, tuple[str, ...]]:
    """(sliding_window, layer_types) of a config.json: the window None and the kinds empty when no layer slides."""
    default = GEMMA_DEFAULTS.get(arch, {}).get("sliding_window")
    sliding = cfg.get("sliding_window", default) if cfg.get("use_sliding_window", True) else None
    if arch in _USE_SLIDING_WINDOW and not cfg.get("use_sliding_window", False):
        sliding = None
    if arch in _ALL_LAYERS and sliding is not None and sliding >= cfg.get("max_position_embeddings", 0):
        sliding = None  # a window as long as the context is no window at all
    if sliding is not None and arch not in WINDOWED_ARCHITECTURES:
        raise ValueError(f"sliding-window attention (sliding_window={sliding}) of {arch} is not supported by "
                         f"cpllm (windows run for {', '.join(WINDOWED_ARCHITECTURES)}); use a model without it")
    layers = cfg["num_hidden_layers"]
    kinds = cfg.get("layer_types")
    if arch in _ALL_LAYERS or not kinds:  # transformers' Mistral, Mixtral and Qwen3-MoE read no layer_types
        kinds = _default_layer_types(arch, cfg, sliding, layers)
    if sliding is None or SLIDING not in kinds:  # transformers: a "sliding" layer without a window attends fully
        return None, ()
    return sliding, tuple(kinds)


def hf_gemma_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields of Gemma's attention, MLP, rotary and logits, from a config.json ({} elsewhere)."""
    fields: dict[str, Any] = {}
    if arch in GEMMA_ARCHITECTURES:
        if cfg.get("use_bidirectional_attention"):
            raise ValueError(f"{arch} with use_bidirectional_attention=True (an encoder) is not supported")
        defaults = GEMMA_DEFAULTS[arch]
        fields.update(
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar", 256),
            final_logit_softcapping=cfg.get("final_logit_softcapping", defaults["final_logit_softcapping"]),
            # transformers' Gemma3 attention never applies attn_logit_softcapping, so neither does cpllm
            attn_logit_softcapping=cfg.get("attn_logit_softcapping", defaults["attn_logit_softcapping"])
            if arch == "Gemma2ForCausalLM" else None,
            hidden_activation=cfg.get("hidden_activation") or "gelu_pytorch_tanh",  # what transformers reads
        )
    if arch == "Gemma3ForCausalLM":
        fields["rope_local_theta"] = float(cfg.get("rope_local_base_freq", 10000.0))
    return fields


def check_attention_fields(config) -> None:
    """ModelConfig's window and Gemma fields, each refused with its value and the limit (layer_types itself is
    checked in config/engine.py)."""
    arch, window = config.architecture, config.sliding_window
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"sliding_window must be an integer >= 1, got {window!r}")
    for name in ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"):
        value = getattr(config, name)
        if value is not None and arch not in GEMMA_ARCHITECTURES:
            raise ValueError(f"{name}={value} with {arch}: only {', '.join(GEMMA_ARCHITECTURES)} read it")
        if value is not None and not value > 0:
            raise ValueError(f"{name} must be > 0, got {value}")
    if config.rope_local_theta is not None and arch != "Gemma3ForCausalLM":
        raise ValueError(f"rope_local_theta={config.rope_local_theta} with {arch}: only Gemma3ForCausalLM reads it")
    if arch in GEMMA_ARCHITECTURES and config.hidden_activation not in GEMMA_ACTIVATIONS:
        raise ValueError(f"{arch} with hidden_activation={config.hidden_activation!r}; supported: "
                         f"{', '.join(GEMMA_ACTIVATIONS)}")
    if arch not in GEMMA_ARCHITECTURES and config.hidden_activation != "silu":
        raise ValueError(f"{arch} with hidden_activation={config.hidden_activation!r}; its MLP is SiLU-gated")


def check_compile_decode_attention(config, max_model_len: int) -> None:
    """compile_decode=True: the compiled step's attention kernels know no window and no soft-cap (PagedCPAttention
    refuses the plan), so a model with a window shorter than max_model_len, or with Gemma's layers, is refused."""
    windowed = [i for i in range(config.num_hidden_layers) if layer_window(config, i, max_model_len) is not None]
    if windowed:
        raise ValueError(f"compile_decode=True with sliding_window={config.sliding_window} < max_model_len="
                         f"{max_model_len} (layers {windowed}): the compiled decode step applies no window; run "
                         "without compile_decode")
    if config.architecture in GEMMA_ARCHITECTURES:
        raise ValueError(f"compile_decode=True with {config.architecture}: its layers decode eager only; run "
                         "without compile_decode")


def layer_kind(config, index: int) -> str:
    """Layer `index`'s attention kind: `layer_types[index]`; without layer_types, every layer slides when
    sliding_window is set (Mistral's rule), else none does."""
    if config.layer_types:
        return config.layer_types[index]
    return SLIDING if config.sliding_window is not None else FULL


def layer_window(config, index: int, max_positions: int | None = None) -> int | None:
    """The window of layer `index` (None: full attention). A window no shorter than `max_positions` (the longest
    request) hides no key from any query, so it is dropped: the layer keeps the full-attention paths."""
    if layer_kind(config, index) != SLIDING:
        return None
    window = config.sliding_window
    return None if max_positions is not None and window >= max_positions else window
