"""llama.cpp's `kimi-linear` GGUF architecture (Kimi Linear: Kimi delta attention layers interleaved with MLA
layers, the DeepSeek MoE): its metadata read back into a config.json dictionary, its tensor names mapped onto the
Hugging Face checkpoint's, and the converter's transforms undone, so cpllm/model/families/kimi_linear.py loads the
same model as from the safetensors folder.

What llama.cpp's converter (conversion/kimi_linear.py, KimiLinearModel, on the shared TextModel) does, and how
reading undoes it:
- the KDA layers keep their projections under llama.cpp names: q/k/v_proj as `attn_q` / `attn_k` / `attn_v`
  (unpermuted: nothing is rotated), o_proj as `attn_output`, f_a/f_b_proj as `ssm_f_a` / `ssm_f_b`, g_a/g_b_proj as
  `ssm_g_a` / `ssm_g_b`, b_proj as `ssm_beta`, o_norm as `ssm_norm` (stored as w: the gated norm scales by w);
- q/k/v_conv1d [C, 1, K] are reshaped to [1, C, 1, K] (`ssm_conv1d_q` / `_k` / `_v`; a quantizer may drop the
  leading 1): read as HF's [C, 1, K], so a TP shard's rows slice the channels;
- A_log [1, 1, H, 1] is stored as A = -exp(A_log) (`ssm_a`): read back as log(-A);
- dt_bias is renamed dt_proj.bias (`ssm_dt.bias`);
- the MLA layers as DeepSeek's (gguf_deepseek.py): q_proj (or q_a / q_a_norm / q_b), `attn_kv_a_mqa`,
  `attn_kv_a_norm`, and kv_b_proj split per head into `attn_k_b` [H, r, nope] (the key rows transposed) and
  `attn_v_b` [H, v, r], which MLAAttention joins back (a whole `attn_kv_b`, as older files have it, is read too);
- experts stacked per projection (w1 -> ffn_gate_exps, w3 -> ffn_up_exps, w2 -> ffn_down_exps; gguf_moe.py), the
  router `ffn_gate_inp`, its correction bias `exp_probs_b.bias`, the shared experts `ffn_*_shexp`; the dense
  layers' MLP as `ffn_gate` / `ffn_up` / `ffn_down`; the norms as they are (plain RMSNorms: no 1 + w).
Metadata: which layers are KDA in `attention.head_count_kv`, one count per layer (0: KDA, else MLA); the KDA heads
are `attention.head_count` (llama.cpp builds both kinds with it: Kimi Linear has as many KDA heads as MLA heads),
their width `kda.head_dim`, the convolution's taps `ssm.conv_kernel`; MLA's widths as for deepseek2
(`attention.kv_lora_rank`, `attention.q_lora_rank`, `rope.dimension_count`, `attention.key_length_mla` /
`value_length_mla`); the MoE's `expert_count`, `expert_used_count`, `expert_feed_forward_length`,
`expert_shared_count`, `leading_dense_block_count` (the dense layers), `expert_weights_scale`,
`expert_group_count` / `expert_group_used_count` (when written), `expert_gating_func` (sigmoid). The converter
writes no `expert_weights_norm`: llama.cpp always renormalises this architecture's top k, as Kimi's
moe_renormalize does, and so does cpllm unless the file says otherwise.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from cpllm.model.loaders.gguf_file import arch_meta

KIMI_GGUF_ARCH = "kimi-linear"
SIGMOID_GATING = 2
"""llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID (`expert_gating_func`): Kimi's router scores."""

_LAYER_NAMES = {
    "ssm_conv1d_q.weight": "self_attn.q_conv1d.weight",
    "ssm_conv1d_k.weight": "self_attn.k_conv1d.weight",
    "ssm_conv1d_v.weight": "self_attn.v_conv1d.weight",
    "ssm_f_a.weight": "self_attn.f_a_proj.weight",
    "ssm_f_b.weight": "self_attn.f_b_proj.weight",
    "ssm_g_a.weight": "self_attn.g_a_proj.weight",
    "ssm_g_b.weight": "self_attn.g_b_proj.weight",
    "ssm_beta.weight": "self_attn.b_proj.weight",
    "ssm_a": "self_attn.A_log",
    "ssm_dt.bias": "self_attn.dt_bias",
    "ssm_norm.weight": "self_attn.o_norm.weight",
    "exp_probs_b.bias": "block_sparse_moe.gate.e_score_correction_bias",
    "ffn_gate_shexp.weight": "block_sparse_moe.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "block_sparse_moe.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "block_sparse_moe.shared_experts.down_proj.weight",
}
"""Layer tensors (after `blk.N.`) whose HF name is Kimi's own; MLA's are DeepSeek's (gguf_deepseek.py), the rest
Llama's, the experts and router the MoE files' (gguf_moe.py)."""
NOT_READ_TENSORS = {
    "attn_gate.weight": "a full-rank output gate (Kimi-K3's), which Kimi Linear has not",
    "ffn_latent_down.weight": "a latent MoE projection (Kimi-K3's)",
    "attn_res_proj.weight": "attention residuals (Kimi-K3's)",
}
"""Layer tensors llama.cpp's loader accepts for this architecture that Kimi Linear has not: refused by name."""
_CONV = ("ssm_conv1d_q.weight", "ssm_conv1d_k.weight", "ssm_conv1d_v.weight")


def kimi_layer_name(rest: str) -> str | None:
    """The HF name (after `model.layers.N.`) of a kimi-linear layer tensor this module maps, else None."""
    return _LAYER_NAMES.get(rest)


def kimi_hf_shape(rest: str, shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """HF's shape of a layer tensor the converter reshaped (the convolutions: [1, C, 1, K] or [C, 1, K] -> [C, 1, K]),
    else None."""
    if rest not in _CONV:
        return None
    return (int(np.prod(shape[:-1])), 1, shape[-1])


def kimi_values(name: str, out: np.ndarray) -> np.ndarray:
    """The HF values of a read tensor: A_log back from the stored A = -exp(A_log); the rest as stored."""
    return np.log(-out) if name.endswith("self_attn.A_log") else out


def float32_decimal(value: float) -> float:
    """A float32 metadata value as the shortest decimal that float32 rounds to it: the config.json value it was
    written from (2.446, not 2.4460000991821289), so the config equals the folder's."""
    return float(str(np.float32(value)))


def kimi_hf_config(meta: Callable[[str, Any], Any], tensor_shapes: dict[str, tuple[int, ...]],
                   eos_ids: tuple[int, ...]) -> dict[str, Any]:
    """The config.json dictionary of a kimi-linear GGUF file (see the module), after checking every layer's tensors
    against it."""
    m = arch_meta(meta, KIMI_GGUF_ARCH, "Kimi Linear")

    layers, heads = int(m("block_count", required=True)), int(m("attention.head_count", required=True))
    per_layer = m("attention.head_count_kv", required=True)
    if not isinstance(per_layer, (list, tuple)) or len(per_layer) != layers:
        raise ValueError(f"{KIMI_GGUF_ARCH} attention.head_count_kv={per_layer!r}: the converter writes one count "
                         f"per layer (0 on the Kimi delta attention layers), {layers} of them")
    gating = int(m("expert_gating_func", SIGMOID_GATING))
    if gating != SIGMOID_GATING:
        raise ValueError(f"{KIMI_GGUF_ARCH} expert_gating_func={gating}: Kimi Linear's router scores by sigmoid "
                         f"({SIGMOID_GATING})")
    rope = int(m("rope.dimension_count", required=True))
    key_width = int(m("attention.key_length_mla", required=True))
    dense = int(m("leading_dense_block_count", 0) or 0)
    bos = meta("tokenizer.ggml.bos_token_id", None)
    cfg: dict[str, Any] = dict(
        architectures=["KimiLinearForCausalLM"], vocab_size=tensor_shapes["token_embd.weight"][0],
        hidden_size=int(m("embedding_length", required=True)),
        intermediate_size=int(m("feed_forward_length", required=True)), num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads,
        kv_lora_rank=int(m("attention.kv_lora_rank", required=True)),
        q_lora_rank=int(m("attention.q_lora_rank", 0) or 0) or None,
        qk_rope_head_dim=rope, qk_nope_head_dim=key_width - rope,
        v_head_dim=int(m("attention.value_length_mla", required=True)),
        layer_types=["full_attention" if n else "linear_attention" for n in per_layer],
        linear_num_heads=heads, linear_head_dim=int(m("kda.head_dim", required=True)),
        linear_conv_kernel_dim=int(m("ssm.conv_kernel", required=True)),
        n_routed_experts=int(m("expert_count", required=True)),
        num_experts_per_tok=int(m("expert_used_count", required=True)),
        moe_intermediate_size=int(m("expert_feed_forward_length", required=True)),
        n_shared_experts=int(m("expert_shared_count", 1)),
        routed_scaling_factor=float32_decimal(m("expert_weights_scale", 1.0)),
        norm_topk_prob=bool(m("expert_weights_norm", True)),
        n_group=int(m("expert_group_count", 1) or 1), topk_group=int(m("expert_group_used_count", 1) or 1),
        mlp_layer_types=["dense" if i < dense else "sparse" for i in range(layers)],
        rms_norm_eps=float32_decimal(m("attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(m("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensor_shapes, bos_token_id=None if bos is None else int(bos),
        eos_token_id=list(eos_ids),
    )
    _check_tensors(cfg, tensor_shapes)
    return cfg


def _kda_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Each KDA layer tensor (after `blk.N.`) -> its shape in HF order, by the metadata."""
    hidden, h, d = cfg["hidden_size"], cfg["linear_num_heads"], cfg["linear_head_dim"]
    conv = (h * d, 1, cfg["linear_conv_kernel_dim"])
    return {"attn_q.weight": (h * d, hidden), "attn_k.weight": (h * d, hidden), "attn_v.weight": (h * d, hidden),
            **{name: conv for name in _CONV}, "ssm_f_a.weight": (d, hidden), "ssm_f_b.weight": (h * d, d),
            "ssm_g_a.weight": (d, hidden), "ssm_g_b.weight": (h * d, d), "ssm_beta.weight": (h, hidden),
            "ssm_a": (h,), "ssm_dt.bias": (h * d,), "ssm_norm.weight": (d,), "attn_output.weight": (hidden, h * d)}


def _mla_shapes(cfg: dict[str, Any], stored: set[str], i: int) -> dict[str, tuple[int, ...]]:
    """Each MLA layer tensor (after `blk.N.`) -> its shape in HF order: the queries direct or through q_lora_rank,
    kv_b_proj split (current converters) or whole (older files)."""
    hidden, h, r = cfg["hidden_size"], cfg["num_attention_heads"], cfg["kv_lora_rank"]
    nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    q_rank = cfg["q_lora_rank"]
    want = {"attn_kv_a_mqa.weight": (r + rope, hidden), "attn_kv_a_norm.weight": (r,),
            "attn_output.weight": (hidden, h * v)}
    if q_rank:
        want.update({"attn_q_a.weight": (q_rank, hidden), "attn_q_a_norm.weight": (q_rank,),
                     "attn_q_b.weight": (h * (nope + rope), q_rank)})
    else:
        want["attn_q.weight"] = (h * (nope + rope), hidden)
    if f"blk.{i}.attn_kv_b.weight" in stored:
        want["attn_kv_b.weight"] = (h * (nope + v), r)
    else:
        want.update({"attn_k_b.weight": (h, r, nope), "attn_v_b.weight": (h, v, r)})
    return want


def _check_tensors(cfg: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]]) -> None:
    """Every layer's tensors present and shaped as the metadata says (the KDA heads are attention.head_count,
    llama.cpp's rule), so a file whose layers or keys disagree is named at open rather than at load."""
    for name in tensor_shapes:
        rest = name.split(".", 2)[-1] if name.startswith("blk.") else None
        if rest in NOT_READ_TENSORS:
            raise ValueError(f"GGUF tensor {name} ({NOT_READ_TENSORS[rest]}) is not read: cpllm reads Kimi Linear")
    stored = set(tensor_shapes)
    for i, kind in enumerate(cfg["layer_types"]):
        kda = kind == "linear_attention"
        want = _kda_shapes(cfg) if kda else _mla_shapes(cfg, stored, i)
        dense = cfg["mlp_layer_types"][i] == "dense"
        need = [*want, *(("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight") if dense else
                         ("ffn_gate_inp.weight", "exp_probs_b.bias", "ffn_down_exps.weight"))]
        missing = [f"blk.{i}.{rest}" for rest in need if f"blk.{i}.{rest}" not in stored]
        if missing:
            raise ValueError(f"{KIMI_GGUF_ARCH} GGUF file lacks {', '.join(missing)}: layer {i} is "
                             f"{'a Kimi delta attention' if kda else 'an MLA'} layer (attention.head_count_kv) with "
                             f"{'a dense MLP' if dense else 'experts'} (leading_dense_block_count)")
        for rest, shape in want.items():
            got = tuple(tensor_shapes[f"blk.{i}.{rest}"])
            reshaped = kimi_hf_shape(rest, got) or (got if rest != "ssm_a" else (int(np.prod(got)),))
            if reshaped != shape:
                raise ValueError(
                    f"{KIMI_GGUF_ARCH} GGUF tensor blk.{i}.{rest} has shape {got}; the metadata "
                    f"(attention.head_count={cfg['num_attention_heads']}, kda.head_dim={cfg['linear_head_dim']}, "
                    f"ssm.conv_kernel={cfg['linear_conv_kernel_dim']}, attention.kv_lora_rank={cfg['kv_lora_rank']}, "
                    f"embedding_length={cfg['hidden_size']}) needs {shape}")
