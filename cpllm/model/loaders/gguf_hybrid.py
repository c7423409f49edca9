"""The gated-DeltaNet hybrids in llama.cpp's GGUF files (architectures `qwen3next`, `qwen35`, `qwen35moe`): their
metadata read back into a config.json dictionary, their tensor names mapped onto Hugging Face's, and the converter's
reshuffles undone, so cpllm/model/families/qwen3_5.py loads the same model as from the safetensors folder.

What llama.cpp's converter (convert_hf_to_gguf.py: Qwen3NextModel, the Qwen3.5 classes on top of it) does, and
how reading undoes it:
- Qwen3-Next's `in_proj_qkvz` (per key head h: [q_h, k_h, v_h, z_h], v_h and z_h the value heads of h) is split
  into `attn_qkv` ([q of every head | k of every head | v of every value head]) and `attn_gate` (z): exactly
  Qwen3.5's separate `in_proj_qkv` and `in_proj_z`. The file is read as that separate layout (ModelConfig's
  `linear_attention.fused_projections` is False for it): the same rows, so the same model. `in_proj_ba` stays
  fused as `ssm_ba` (per key head [b_h, a_h]); its b and a rows are offered as `in_proj_b` / `in_proj_a`.
- Qwen3.5 (dense and MoE) with fewer key heads than value heads: the value heads are moved from HF's grouped
  order (value head h * r + j serves key head h, r = value heads per key head) to a tiled one (GGUF head
  j * Hk + h) wherever they appear: the v rows of `attn_qkv`, the rows of `attn_gate`, `ssm_beta`, `ssm_alpha`,
  `ssm_a`, `ssm_dt`, the v channels of `ssm_conv1d` and the columns of `ssm_out`. Rows are put back by a row
  order (free for any storage type: a row is whole blocks); `ssm_out`'s columns are gathered after
  dequantizing, so a block-quantized `ssm_out` of such a file is read as floats.
- `A_log` is stored as A = -exp(A_log) (`ssm_a`): read back as log(-A).
- `dt_bias` is `ssm_dt.bias`; the convolution weight [C, 1, K] is squeezed to [C, K] (unsqueezed back).
- every `*norm.weight` but the gated DeltaNet norm's (`ssm_norm`, which scales by w) is stored as 1 + w, since
  these models' RMSNorm multiplies by (1 + w): read back as w.
- the full-attention layers' q_proj ([q_h | gate_h] per head) and k / v / o are stored as they are (no rotary
  reordering: llama.cpp rotates these heads as HF does, halves apart).
- experts: stacked per projection as for every MoE file (gguf_moe.py), or gate and up in one `ffn_gate_up_exps`
  stack (gate rows first); the shared expert and its sigmoid gate as `ffn_*_shexp` / `ffn_gate_inp_shexp`.
Metadata: the DeltaNet shapes in `ssm.*` (conv_kernel: taps; state_size: key head width; group_count: key heads;
time_step_rank: value heads; inner_size: value heads x value head width), `full_attention_interval` (layer i is
full attention iff (i + 1) % interval == 0, llama.cpp's rule and transformers' default), the rotated width of each
full-attention head in `rope.dimension_count` (head_dim x partial_rotary_factor).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from cpllm.config.engine import ModelConfig
from cpllm.model.loaders.gguf_file import arch_meta

HYBRID_GGUF_ARCHITECTURES = {"qwen3next": "Qwen3NextForCausalLM", "qwen35": "Qwen3_5ForCausalLM",
                             "qwen35moe": "Qwen3_5MoeForCausalLM"}
"""GGUF `general.architecture` of a gated-DeltaNet hybrid -> Hugging Face architecture."""
TILED_V_HEADS = ("qwen35", "qwen35moe")
"""Architectures whose converter moves the value heads to tiled order when key heads < value heads."""
NORM_TOPK_DEFAULT = {"qwen3next": True, "qwen35moe": True}
"""Whether the router renormalises its top k when the file has no expert_weights_norm (the HF models' values:
Qwen3-Next's config sets norm_topk_prob, Qwen3.5-MoE always renormalises)."""

_LAYER_NAMES = {
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_a": "linear_attn.A_log",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
}
"""Layer tensors (after `blk.N.`) whose HF name differs from Llama's; the rest map as for Llama / Qwen3."""
FUSED_BA = "ssm_ba.weight"
"""Qwen3-Next's `in_proj_ba`, kept fused per key head: offered as in_proj_b and in_proj_a (hybrid_row_views)."""
NOT_READ_TENSORS = {"ssm_in.weight": "an unsplit in_proj_qkvz, whose row layout the converter does not document"}
"""Layer tensors an older or other writer may leave, whose layout is not checked: refused by name."""


def hybrid_layer_name(rest: str) -> str | None:
    """The HF name (after `model.layers.N.`) of a hybrid layer tensor whose name differs from Llama's, or None."""
    return _LAYER_NAMES.get(rest)


def hybrid_row_views(rest: str, config: ModelConfig) -> list[tuple[str, np.ndarray]]:
    """(HF name after `model.layers.N.`, stored rows) of the tensors read as row selections of one stored tensor:
    in_proj_b and in_proj_a from Qwen3-Next's fused `ssm_ba` (key head h: rows [b_h (r rows), a_h (r rows)]); []
    for any other tensor."""
    if rest != FUSED_BA:
        return []
    linear = config.linear_attention
    r = linear.num_value_heads // linear.num_key_heads
    per_head = np.arange(linear.num_key_heads * 2 * r).reshape(linear.num_key_heads, 2, r)  # [h, b | a, j]
    return [("linear_attn.in_proj_b.weight", per_head[:, 0].reshape(-1)),
            ("linear_attn.in_proj_a.weight", per_head[:, 1].reshape(-1))]


def tiled_order(key_heads: int, per_key: int, width: int) -> np.ndarray:
    """For each index of HF's grouped value-head order (value head h * per_key + j, `width` values each), the
    index that holds it in the converter's tiled order (head j * key_heads + h)."""
    return np.arange(key_heads * per_key * width).reshape(per_key, key_heads, width).transpose(1, 0, 2).reshape(-1)


def stores_one_plus_w(name: str) -> bool:
    """Whether the converter stored this HF tensor as 1 + w: every norm weight but the gated DeltaNet norm's."""
    return name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight")


class HybridLayout:
    """What a hybrid file stores differently from the HF checkpoint, per HF tensor name: the stored row of each HF
    row, the stored column of each HF column, and the values' own transform (GGUFSource applies them)."""

    def __init__(self, arch: str, config: ModelConfig):
        linear = config.linear_attention
        self.qk_rows = 2 * linear.key_dim  # q and k rows / channels, never reordered
        self.tiled = arch in TILED_V_HEADS and linear.num_key_heads != linear.num_value_heads
        per_key = linear.num_value_heads // linear.num_key_heads
        self._heads = tiled_order(linear.num_key_heads, per_key, 1)
        self._values = tiled_order(linear.num_key_heads, per_key, linear.value_head_dim)

    def row_order(self, name: str) -> np.ndarray | None:
        """The stored row of each HF row (1-D tensors: of each value), or None where they are in HF's order."""
        if not self.tiled or ".linear_attn." not in name:
            return None
        if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):  # q | k as they are, then v of each value head
            return np.concatenate([np.arange(self.qk_rows), self.qk_rows + self._values])
        if name.endswith("in_proj_z.weight"):
            return self._values
        if name.endswith(("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias")):
            return self._heads
        return None

    def column_order(self, name: str) -> np.ndarray | None:
        """The stored column of each HF column (out_proj's inputs are the value heads' outputs), or None."""
        return self._values if self.tiled and name.endswith("linear_attn.out_proj.weight") else None

    @staticmethod
    def values(name: str, out: np.ndarray) -> np.ndarray:
        """The HF values of a read (and row-ordered) tensor: 1 + w and -exp(A_log) undone, the conv's axis back."""
        if stores_one_plus_w(name):
            return out - np.float32(1)
        if name.endswith("linear_attn.A_log"):
            return np.log(-out)
        if name.endswith("linear_attn.conv1d.weight"):
            return out[:, None, :]  # [C, K] -> HF's [C, 1, K]
        return out


def _layer_types(meta: Callable[[str, Any], Any], arch: str, layers: int) -> list[str]:
    interval = int(meta(f"{arch}.full_attention_interval", 4))
    if interval < 1:
        raise ValueError(f"{arch} full_attention_interval={interval} must be >= 1")
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]


def hybrid_hf_config(arch: str, meta: Callable[[str, Any], Any], tensor_shapes: dict[str, tuple[int, ...]],
                     eos_ids: tuple[int, ...], rope_scaling: dict[str, Any] | None) -> dict[str, Any]:
    """The config.json dictionary of a hybrid GGUF file (see the module); `rope_scaling` as the shared GGUF reader
    gives it."""
    m = arch_meta(meta, arch, "a gated-DeltaNet hybrid")

    layers, heads = int(m("block_count", required=True)), int(m("attention.head_count", required=True))
    hidden = int(m("embedding_length", required=True))
    kv_heads = m("attention.head_count_kv", heads)
    if isinstance(kv_heads, (list, tuple)):  # per layer: 0 on the DeltaNet layers
        counts = sorted({int(n) for n in kv_heads if n})
        if len(counts) != 1:
            raise ValueError(f"{arch} attention.head_count_kv={kv_heads}: one count shared by the full layers is "
                             "supported")
        kv_heads = counts[0]
    head_dim = int(m("attention.key_length", hidden // heads))
    if int(m("attention.value_length", head_dim)) != head_dim:
        raise ValueError(f"{arch} attention.key_length={head_dim} differs from "
                         f"value_length={m('attention.value_length')}; not supported")
    rotary = int(m("rope.dimension_count", head_dim))
    value_heads = int(m("ssm.time_step_rank", required=True))
    inner = int(m("ssm.inner_size", required=True))
    if inner % value_heads:
        raise ValueError(f"{arch} ssm.inner_size={inner} is not a multiple of ssm.time_step_rank={value_heads} "
                         "(the value heads)")
    bos = meta("tokenizer.ggml.bos_token_id", None)
    experts = m("expert_count")
    width = m("feed_forward_length") or m("expert_feed_forward_length", required=True)
    cfg: dict[str, Any] = dict(
        architectures=[HYBRID_GGUF_ARCHITECTURES[arch]], vocab_size=tensor_shapes["token_embd.weight"][0],
        hidden_size=hidden, intermediate_size=int(width), num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=int(kv_heads), head_dim=head_dim, partial_rotary_factor=rotary / head_dim,
        rms_norm_eps=float(m("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(m("rope.freq_base", 10000.0)), rope_scaling=rope_scaling,
        max_position_embeddings=int(m("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensor_shapes, layer_types=_layer_types(meta, arch, layers),
        linear_conv_kernel_dim=int(m("ssm.conv_kernel", required=True)),
        linear_key_head_dim=int(m("ssm.state_size", required=True)),
        linear_num_key_heads=int(m("ssm.group_count", required=True)), linear_num_value_heads=value_heads,
        linear_value_head_dim=inner // value_heads,
        bos_token_id=None if bos is None else int(bos), eos_token_id=list(eos_ids),
    )
    if experts:
        cfg.update(num_experts=int(experts), num_experts_per_tok=int(m("expert_used_count", required=True)),
                   moe_intermediate_size=int(m("expert_feed_forward_length", required=True)),
                   shared_expert_intermediate_size=int(m("expert_shared_feed_forward_length", 0) or 0),
                   norm_topk_prob=bool(m("expert_weights_norm", NORM_TOPK_DEFAULT.get(arch, True))),
                   decoder_sparse_step=1,
                   mlp_only_layers=[i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_shapes])
    elif arch != "qwen35":
        raise ValueError(f"{arch} GGUF file has no {arch}.expert_count; {HYBRID_GGUF_ARCHITECTURES[arch]} is a "
                         "mixture of experts")
    _check_shapes(arch, cfg, tensor_shapes)
    return cfg


_DELTANET_TENSORS = ("attn_qkv.weight", "attn_gate.weight", "ssm_conv1d.weight", "ssm_a", "ssm_dt.bias",
                     "ssm_norm.weight", "ssm_out.weight")
"""Tensors every gated DeltaNet layer of a hybrid file holds, besides b and a (ssm_beta + ssm_alpha, or ssm_ba)."""
_ATTENTION_TENSORS = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
                      "attn_q_norm.weight", "attn_k_norm.weight")
"""Tensors every full-attention layer holds."""


def _check_shapes(arch: str, cfg: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]]) -> None:
    """Every layer's mixer tensors present, and the DeltaNet ones shaped by the ssm.* metadata, so that a file
    whose layers or keys disagree is named at open rather than at load."""
    for name in tensor_shapes:
        rest = name.split(".", 2)[-1] if name.startswith("blk.") else None
        if rest in NOT_READ_TENSORS:
            raise ValueError(f"GGUF tensor {name} ({NOT_READ_TENSORS[rest]}) is not read: convert the model with a "
                             "current llama.cpp converter, or load its Hugging Face folder")
    hk, hv, dk = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"], cfg["linear_key_head_dim"]
    dv, hidden, taps = cfg["linear_value_head_dim"], cfg["hidden_size"], cfg["linear_conv_kernel_dim"]
    channels = 2 * hk * dk + hv * dv
    for i, kind in enumerate(cfg["layer_types"]):
        need = _DELTANET_TENSORS if kind == "linear_attention" else _ATTENTION_TENSORS
        missing = [f"blk.{i}.{rest}" for rest in need if f"blk.{i}.{rest}" not in tensor_shapes]
        if kind == "linear_attention" and f"blk.{i}.ssm_ba.weight" not in tensor_shapes:
            missing += [f"blk.{i}.{rest}" for rest in ("ssm_beta.weight", "ssm_alpha.weight")
                        if f"blk.{i}.{rest}" not in tensor_shapes]
        if missing:
            raise ValueError(f"{arch} GGUF file lacks {', '.join(missing)}: layer {i} is "
                             f"{'a gated DeltaNet' if kind == 'linear_attention' else 'a full-attention'} layer "
                             f"(full_attention_interval)")
        if kind != "linear_attention":
            continue
        want = {f"blk.{i}.attn_qkv.weight": (channels, hidden), f"blk.{i}.attn_gate.weight": (hv * dv, hidden),
                f"blk.{i}.ssm_conv1d.weight": (channels, taps), f"blk.{i}.ssm_a": (hv,),
                f"blk.{i}.ssm_norm.weight": (dv,), f"blk.{i}.ssm_out.weight": (hidden, hv * dv)}
        for name, shape in want.items():
            if tuple(tensor_shapes[name]) != shape:
                raise ValueError(f"{arch} GGUF tensor {name} has shape {tuple(tensor_shapes[name])}; the metadata "
                                 f"(ssm.group_count={hk}, ssm.state_size={dk}, ssm.time_step_rank={hv}, "
                                 f"ssm.inner_size={hv * dv}, ssm.conv_kernel={taps}) needs {shape}")


def split_projections(config: ModelConfig) -> ModelConfig:
    """The config a hybrid file is read with: its DeltaNet input projections are the separate q|k|v, z, b and a
    (Qwen3-Next's fused in_proj_qkvz split by the converter), whatever the architecture stores in a folder."""
    from dataclasses import replace

    return replace(config, linear_attention=replace(config.linear_attention, fused_projections=False))
