"""llama.cpp's `glm-dsa` GGUF architecture (GLM-5: MLA with DeepSeek sparse attention's lightning indexer in every
layer, the DeepSeek MoE): its metadata read back into a config.json dictionary, its tensor names mapped onto the
Hugging Face checkpoint's, and the multi-token-prediction block left out, so cpllm/model/families/deepseek_sparse.py
loads the same model as from the safetensors folder.

What llama.cpp's converter (conversion/glm.py, GlmMoeDsaModel on DeepseekV2Model and the shared TextModel) does, and
how reading undoes it:
- MLA as for deepseek2 (gguf_deepseek.py): q_a_proj / q_a_layernorm / q_b_proj as `attn_q_a` / `attn_q_a_norm` /
  `attn_q_b`, `attn_kv_a_mqa`, `attn_kv_a_norm`, o_proj as `attn_output`, and kv_b_proj split per head into
  `attn_k_b` [H, r, nope] (the key rows transposed) and `attn_v_b` [H, v, r], which MLAAttention joins back (a whole
  `attn_kv_b`, as llama.cpp still names, is read too). No row is permuted: llama.cpp rotates this architecture's
  MLA and index rope parts as interleaved pairs, as GLM-5 does, and both rope parts lead their heads as in HF;
- the indexer's weights renamed only: wq_b -> `indexer.attn_q_b`, wk -> `indexer.attn_k`, weights_proj ->
  `indexer.proj`, its LayerNorm k_norm (weight and bias) -> `indexer.k_norm`;
- the router `ffn_gate_inp`, its correction bias (renamed e_score_correction.bias) `exp_probs_b.bias`, experts
  stacked per projection (gguf_moe.py), the shared experts `ffn_*_shexp`, the leading dense layers' MLP as
  `ffn_gate` / `ffn_up` / `ffn_down`; the norms as they are (plain RMSNorms: no 1 + w);
- the multi-token-prediction block that GLM-5 checkpoints append (model.layers.N for N >= num_hidden_layers, which
  transformers ignores) is written unless the converter ran with --no-mtp: `block_count` then counts it and
  `nextn_predict_layers` says how many blocks it adds; their tensors (a whole layer plus `nextn.*`) are skipped here,
  as llama.cpp skips them;
- a tied lm_head is dropped (`output.weight` absent).
Metadata: TextModel's keys (block_count, embedding_length, feed_forward_length, attention.head_count, rms epsilon,
rope.freq_base, expert_count / expert_used_count / expert_group_count / expert_group_used_count, rope.scaling.*),
deepseek2's MLA widths (attention.q_lora_rank, kv_lora_rank, key_length_mla / value_length_mla,
rope.dimension_count), its MoE keys (expert_feed_forward_length, expert_shared_count, leading_dense_block_count,
expert_weights_scale, expert_weights_norm; expert_gating_func sigmoid, llama.cpp's default here) and the indexer's
`attention.indexer.head_count` / `key_length` / `top_k`, with `attention.indexer.types` (one flag per layer, true:
"full") where config.json lists indexer_types. llama.cpp reads a file without that key as GLM-5 / 5.1 (every layer
full) below a context_length of 1048576 and as GLM-5.2's pattern of shared layers from there on; layers that reuse
another layer's top-k are not built by cpllm (cpllm/config/sparse_mla.py), so such files are refused.
"""

from __future__ import annotations

import re
from typing import Any, Callable

from cpllm.model.loaders.gguf_deepseek import deepseek_rope_scaling
from cpllm.model.loaders.gguf_file import arch_meta
from cpllm.model.loaders.gguf_kimi import SIGMOID_GATING, float32_decimal

GLM_DSA_GGUF_ARCH = "glm-dsa"
GLM_52_CONTEXT = 1048576
"""llama.cpp reads a glm-dsa file without attention.indexer.types at this context_length or more as GLM-5.2, whose
layers mostly share another layer's top-k."""

NO_GATING = 0
"""llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_NONE, which it reads as sigmoid for this architecture."""

_LAYER_NAMES = {
    "indexer.attn_q_b.weight": "self_attn.indexer.wq_b.weight",
    "indexer.attn_k.weight": "self_attn.indexer.wk.weight",
    "indexer.proj.weight": "self_attn.indexer.weights_proj.weight",
    "indexer.k_norm.weight": "self_attn.indexer.k_norm.weight",
    "indexer.k_norm.bias": "self_attn.indexer.k_norm.bias",
}
"""Layer tensors (after `blk.N.`) whose HF name is the indexer's; MLA's, the shared experts' and the router bias are
DeepSeek's (gguf_deepseek.py), the rest Llama's, the experts and router the MoE files' (gguf_moe.py)."""
_BLOCK_RE = re.compile(r"blk\.(\d+)\.")


def glm_dsa_layer_name(rest: str) -> str | None:
    """The HF name (after `model.layers.N.`) of a glm-dsa indexer tensor, else None."""
    return _LAYER_NAMES.get(rest)


def is_nextn_tensor(gguf_name: str, num_hidden_layers: int) -> bool:
    """Whether a tensor belongs to the appended multi-token-prediction block (blk.N, N >= num_hidden_layers)."""
    match = _BLOCK_RE.match(gguf_name)
    return match is not None and int(match.group(1)) >= num_hidden_layers


def _indexer_types(value: Any, layers: int, context: int) -> list[str]:
    """config.json's indexer_types from `attention.indexer.types` (or llama.cpp's reading of its absence)."""
    if value is None:
        if context >= GLM_52_CONTEXT:
            raise ValueError(
                f"{GLM_DSA_GGUF_ARCH} GGUF file has no attention.indexer.types and context_length={context}: llama.cpp "
                f"reads it as GLM-5.2, whose layers mostly reuse another layer's top-k ('shared'), which cpllm does "
                f"not build")
        return ["full"] * layers
    flags = list(value) if isinstance(value, (list, tuple)) else [value] * layers  # llama.cpp's get_key_or_arr
    if len(flags) != layers:
        raise ValueError(f"{GLM_DSA_GGUF_ARCH} attention.indexer.types has {len(flags)} entries; the model has "
                         f"{layers} layers (block_count less nextn_predict_layers)")
    return ["full" if flag else "shared" for flag in flags]  # IndexerConfig refuses 'shared', naming it


def glm_dsa_hf_config(meta: Callable[[str, Any], Any], tensor_shapes: dict[str, tuple[int, ...]],
                      eos_ids: tuple[int, ...]) -> dict[str, Any]:
    """The config.json dictionary of a glm-dsa GGUF file (see the module), after checking every layer's tensors
    against it."""
    m = arch_meta(meta, GLM_DSA_GGUF_ARCH, "GLM-5")

    blocks, nextn = int(m("block_count", required=True)), int(m("nextn_predict_layers", 0) or 0)
    if not 0 <= nextn < blocks:
        raise ValueError(f"{GLM_DSA_GGUF_ARCH} nextn_predict_layers={nextn} must be below block_count={blocks}")
    layers, context = blocks - nextn, int(m("context_length", 4096))
    gating = int(m("expert_gating_func", SIGMOID_GATING))
    if gating not in (NO_GATING, SIGMOID_GATING):  # llama.cpp scores by sigmoid where the file says none
        raise ValueError(f"{GLM_DSA_GGUF_ARCH} expert_gating_func={gating}: GLM-5's router scores by sigmoid "
                         f"({SIGMOID_GATING})")
    rope = int(m("rope.dimension_count", required=True))
    key_width = int(m("attention.key_length_mla", required=True))  # key_length / value_length: the latent's
    value_width = int(m("attention.value_length_mla", required=True))
    dense = min(int(m("leading_dense_block_count", 0) or 0), layers)
    bos = meta("tokenizer.ggml.bos_token_id", None)
    cfg: dict[str, Any] = dict(
        architectures=["GlmMoeDsaForCausalLM"], vocab_size=tensor_shapes["token_embd.weight"][0],
        hidden_size=int(m("embedding_length", required=True)),
        intermediate_size=int(m("feed_forward_length", required=True)), num_hidden_layers=layers,
        num_attention_heads=int(m("attention.head_count", required=True)),
        kv_lora_rank=int(m("attention.kv_lora_rank", required=True)),
        q_lora_rank=int(m("attention.q_lora_rank", required=True)),
        qk_rope_head_dim=rope, qk_nope_head_dim=key_width - rope, v_head_dim=value_width,
        index_topk=int(m("attention.indexer.top_k", required=True)),
        index_head_dim=int(m("attention.indexer.key_length", required=True)),
        index_n_heads=int(m("attention.indexer.head_count", required=True)),
        indexer_types=_indexer_types(m("attention.indexer.types"), layers, context),
        n_routed_experts=int(m("expert_count", required=True)),
        num_experts_per_tok=int(m("expert_used_count", required=True)),
        moe_intermediate_size=int(m("expert_feed_forward_length", required=True)),
        n_shared_experts=int(m("expert_shared_count", 0) or 0),
        routed_scaling_factor=float32_decimal(m("expert_weights_scale", 1.0)),
        # the converter writes the key only when true; llama.cpp then leaves the top k unnormalised
        norm_topk_prob=bool(m("expert_weights_norm", False)),
        n_group=int(m("expert_group_count", 1) or 1), topk_group=int(m("expert_group_used_count", 1) or 1),
        first_k_dense_replace=dense, mlp_layer_types=["dense" if i < dense else "sparse" for i in range(layers)],
        rms_norm_eps=float32_decimal(m("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float32_decimal(m("rope.freq_base", 10000.0)),
        rope_scaling=deepseek_rope_scaling(meta, GLM_DSA_GGUF_ARCH), max_position_embeddings=context,
        tie_word_embeddings="output.weight" not in tensor_shapes, bos_token_id=None if bos is None else int(bos),
        eos_token_id=list(eos_ids),
    )
    _check_tensors(cfg, tensor_shapes)
    return cfg


def _layer_shapes(cfg: dict[str, Any], stored: set[str], i: int) -> dict[str, tuple[int, ...]]:
    """Each attention tensor of layer i (after `blk.N.`) -> its shape in HF order: MLA (kv_b_proj split, as current
    converters write it, or whole) and the indexer."""
    hidden, h, r = cfg["hidden_size"], cfg["num_attention_heads"], cfg["kv_lora_rank"]
    nope, rope, v, q_rank = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"], cfg["q_lora_rank"]
    heads, width = cfg["index_n_heads"], cfg["index_head_dim"]
    want = {"attn_norm.weight": (hidden,), "attn_q_a.weight": (q_rank, hidden), "attn_q_a_norm.weight": (q_rank,),
            "attn_q_b.weight": (h * (nope + rope), q_rank), "attn_kv_a_mqa.weight": (r + rope, hidden),
            "attn_kv_a_norm.weight": (r,), "attn_output.weight": (hidden, h * v), "ffn_norm.weight": (hidden,),
            "indexer.attn_q_b.weight": (heads * width, q_rank), "indexer.attn_k.weight": (width, hidden),
            "indexer.proj.weight": (heads, hidden), "indexer.k_norm.weight": (width,), "indexer.k_norm.bias": (width,)}
    if f"blk.{i}.attn_kv_b.weight" in stored:
        want["attn_kv_b.weight"] = (h * (nope + v), r)
    else:
        want.update({"attn_k_b.weight": (h, r, nope), "attn_v_b.weight": (h, v, r)})
    return want


def _check_tensors(cfg: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]]) -> None:
    """Every layer's tensors present and shaped as the metadata says, so a file whose layers or keys disagree is
    named at open rather than at load (llama.cpp itself would run a layer without indexer tensors densely)."""
    stored = set(tensor_shapes)
    for i, kind in enumerate(cfg["mlp_layer_types"]):
        want = _layer_shapes(cfg, stored, i)
        dense = kind == "dense"
        need = [*want, *(("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight") if dense else
                         ("ffn_gate_inp.weight", "exp_probs_b.bias", "ffn_down_exps.weight"))]
        missing = [f"blk.{i}.{rest}" for rest in need if f"blk.{i}.{rest}" not in stored]
        if missing:
            raise ValueError(f"{GLM_DSA_GGUF_ARCH} GGUF file lacks {', '.join(missing)}: layer {i} is a sparse-MLA "
                             f"layer with its indexer and {'a dense MLP' if dense else 'experts'} "
                             f"(leading_dense_block_count={cfg['first_k_dense_replace']})")
        for rest, shape in want.items():
            got = tuple(tensor_shapes[f"blk.{i}.{rest}"])
            if got != shape:
                raise ValueError(
                    f"{GLM_DSA_GGUF_ARCH} GGUF tensor blk.{i}.{rest} has shape {got}; the metadata "
                    f"(attention.head_count={cfg['num_attention_heads']}, kv_lora_rank={cfg['kv_lora_rank']}, "
                    f"q_lora_rank={cfg['q_lora_rank']}, indexer.head_count={cfg['index_n_heads']}, "
                    f"indexer.key_length={cfg['index_head_dim']}, embedding_length={cfg['hidden_size']}) needs {shape}")
