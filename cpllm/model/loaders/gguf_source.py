"""Weights from a llama.cpp GGUF file, renamed and reshaped to Hugging Face layout.

Three things differ from a Hugging Face checkpoint:
- names: `blk.N.attn_q.weight` instead of `model.layers.N.self_attn.q_proj.weight`;
- storage: tensors may be block-quantized (Q8_0, Q4_1, K-quants, ...); `get`
  dequantizes them, and a row slice dequantizes only its rows, since a
  quantization block never crosses a row; `get_int4_groups` / `get_int8_groups`
  hand Q4_0 / Q4_1 / Q4_K / Q8_0 blocks out as codes and scales instead
  (cpllm/model/formats/gguf_blocks.py);
- Llama q/k rows: llama.cpp's converter reorders the rows of each head from
  "first half, second half" (HF's rotate-half rotary) to interleaved pairs
  (its own rotary). Reading undoes that so the rows match HF again. Qwen2 is
  converted without the reordering.
Per-family differences live beside this file: gguf_deepseek.py, gguf_gpt_oss.py,
gguf_gemma.py, gguf_moe.py, gguf_hybrid.py (the gated-DeltaNet hybrids: their rows,
columns and values moved or transformed by the converter, put back here on read),
gguf_kimi.py (Kimi Linear: its reshaped convolutions and stored -exp(A_log), put back likewise), gguf_glm_dsa.py
(GLM-5: DeepSeek's MLA tensors, the indexer's, the multi-token-prediction block left out).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

from cpllm.config.engine import QUANT_GROUP, ModelConfig
from cpllm.config.rope import yarn_mscale
from cpllm.model.loaders.gguf_deepseek import DEEPSEEK_GGUF_ARCH, deepseek_hf_config, deepseek_layer_name
from cpllm.model.loaders.gguf_file import GGUFFile, StoredTensor
from cpllm.model.loaders.gguf_gemma import GEMMA_GGUF_ARCHITECTURES, gemma_gguf_fields, gemma_layer_name, stores_one_plus_w
from cpllm.model.loaders.gguf_glm_dsa import GLM_DSA_GGUF_ARCH, glm_dsa_hf_config, glm_dsa_layer_name, is_nextn_tensor
from cpllm.model.loaders.gguf_gpt_oss import (
    GPT_OSS_GGUF_ARCH,
    GptOssExpertStacks,
    expert_stack,
    gpt_oss_hf_config,
    gpt_oss_layer_name,
)
from cpllm.model.loaders.gguf_hybrid import (
    HYBRID_GGUF_ARCHITECTURES,
    HybridLayout,
    hybrid_hf_config,
    hybrid_layer_name,
    hybrid_row_views,
    split_projections,
)
from cpllm.model.loaders.gguf_kimi import (
    KIMI_GGUF_ARCH,
    kimi_hf_config,
    kimi_hf_shape,
    kimi_layer_name,
    kimi_values,
)
from cpllm.model.loaders.gguf_moe import ExpertIndex, gguf_moe_config, hf_architecture, moe_hf_names
from cpllm.model.loaders.weight_slices import resolve_slice
from cpllm.model.formats.gguf_blocks import (
    INT4_GGUF_TYPES,
    INT8_GGUF_TYPES,
    block_bytes,
    block_values,
    decode_int4_blocks,
    decode_int8_blocks,
)
from cpllm.model.formats.groups import Int4Groups, Int8Groups

_Q = GGMLQuantizationType
SUPPORTED_TENSOR_TYPES = frozenset(
    {_Q.F32, _Q.F16, _Q.BF16, _Q.Q4_0, _Q.Q4_1, _Q.Q5_0, _Q.Q5_1, _Q.Q8_0}
    | {_Q.Q2_K, _Q.Q3_K, _Q.Q4_K, _Q.Q5_K, _Q.Q6_K, _Q.MXFP4}
)
"""Tensor types this loader dequantizes (through gguf.quants.dequantize)."""

GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", **GEMMA_GGUF_ARCHITECTURES}
"""GGUF `general.architecture` -> Hugging Face architecture."""

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")
_MLA_GGUF_ARCHITECTURES = (DEEPSEEK_GGUF_ARCH, KIMI_GGUF_ARCH, GLM_DSA_GGUF_ARCH)
"""Architectures whose MLA tensors carry deepseek2's names (gguf_deepseek.py)."""
_QK_RE = re.compile(r"model\.layers\.\d+\.self_attn\.([qk])_proj\.(weight|bias)")


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The Hugging Face name of a llama.cpp tensor name, or None if it has none (`arch`: the file's
    general.architecture; Gemma names its norms differently, cpllm/model/loaders/gguf_gemma.py)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_RE.fullmatch(gguf_name)
    if match is None:
        return None
    rest = (gemma_layer_name(match.group(2)) if arch in GEMMA_GGUF_ARCHITECTURES else None) \
        or (kimi_layer_name(match.group(2)) if arch == KIMI_GGUF_ARCH else None) \
        or (glm_dsa_layer_name(match.group(2)) if arch == GLM_DSA_GGUF_ARCH else None) \
        or (deepseek_layer_name(match.group(2)) if arch in _MLA_GGUF_ARCHITECTURES else None) \
        or (gpt_oss_layer_name(match.group(2)) if arch == GPT_OSS_GGUF_ARCH else None) \
        or (hybrid_layer_name(match.group(2)) if arch in HYBRID_GGUF_ARCHITECTURES else None) \
        or _LAYER_NAMES.get(match.group(2))
    return None if rest is None else f"model.layers.{match.group(1)}.{rest}"


def _meta(reader: GGUFFile, key: str, default: Any = None) -> Any:
    """A metadata value, or `default` when the key is absent."""
    return reader.metadata.get(key, default)


def _eos_ids(reader: GGUFFile) -> tuple[int, ...]:
    # llama.cpp stops on end-of-turn as well as end-of-sequence; keep both, eos first
    ids = [_meta(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot")]
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


def _head_dim(reader: GGUFFile, arch: str, hidden: int, heads: int) -> int:
    head_dim = int(_meta(reader, f"{arch}.attention.key_length", hidden // heads))
    value_dim = int(_meta(reader, f"{arch}.attention.value_length", head_dim))
    rope_dim = int(_meta(reader, f"{arch}.rope.dimension_count", head_dim))
    if value_dim != head_dim:
        raise ValueError(f"key_length={head_dim} differs from value_length={value_dim}; not supported")
    if rope_dim != head_dim:
        raise ValueError(
            f"rope.dimension_count={rope_dim} differs from head_dim={head_dim}: partial rotary is not supported"
        )
    return head_dim


def _rope_scaling(reader: GGUFFile, arch: str, names: set[str]) -> dict[str, Any] | None:
    """config.json's rope_scaling from llama.cpp's `rope.scaling.*` keys: none, linear or yarn."""
    key = lambda name: f"{arch}.rope.scaling.{name}"  # noqa: E731
    kind = _meta(reader, key("type"))
    if "rope_freqs.weight" in names:
        raise ValueError(
            "the GGUF file carries rope_freqs.weight (Llama 3 style frequency scaling), which the GGUF "
            "loader cannot turn into a rope_scaling config; load the Hugging Face folder instead"
        )
    if kind in (None, "none"):
        return None
    if kind not in ("linear", "yarn"):
        raise ValueError(f"GGUF rope scaling type {kind!r} is not supported; supported: none, linear, yarn")
    scaling: dict[str, Any] = {"rope_type": kind, "factor": _meta(reader, key("factor"))}
    if kind == "linear":
        return scaling
    if _meta(reader, key("yarn_log_multiplier")):
        raise ValueError("GGUF yarn with rope.scaling.yarn_log_multiplier (DeepSeek's mscale) is not supported; "
                         "load the Hugging Face folder instead")
    for gguf_key, hf_key in (("original_context_length", "original_max_position_embeddings"),
                             ("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
        if _meta(reader, key(gguf_key)) is not None:
            scaling[hf_key] = _meta(reader, key(gguf_key))
    attn_factor = _meta(reader, key("attn_factor"))
    if attn_factor is not None and scaling["factor"] is not None:
        # llama.cpp multiplies yarn's own magnitude correction by this factor
        scaling["attention_factor"] = float(attn_factor) * yarn_mscale(scaling["factor"])
    return scaling


def gguf_model_config(reader: GGUFFile, tensor_shapes: dict[str, tuple[int, ...]]) -> ModelConfig:
    """ModelConfig from GGUF metadata; `tensor_shapes` (GGUF names, HF order) supply vocab and tying."""
    arch = _meta(reader, "general.architecture")
    meta = lambda key, default: _meta(reader, key, default)  # noqa: E731
    if arch == DEEPSEEK_GGUF_ARCH:  # MLA + the DeepSeek MoE: read as the config.json it stands for
        return ModelConfig.from_hf_config(deepseek_hf_config(meta, tensor_shapes, _eos_ids(reader)))
    if arch == GPT_OSS_GGUF_ARCH:  # sinks, windows, the GPT-OSS MoE: read as the config.json it stands for
        rope_scaling = _rope_scaling(reader, arch, set(tensor_shapes))
        return ModelConfig.from_hf_config(gpt_oss_hf_config(meta, tensor_shapes, _eos_ids(reader), rope_scaling))
    if arch == KIMI_GGUF_ARCH:  # KDA and MLA layers by head_count_kv, the DeepSeek MoE: read as its config.json
        return ModelConfig.from_hf_config(kimi_hf_config(meta, tensor_shapes, _eos_ids(reader)))
    if arch in HYBRID_GGUF_ARCHITECTURES:  # DeltaNet shapes in ssm.*, partial rotary: read as its config.json
        rope_scaling = _rope_scaling(reader, arch, set(tensor_shapes))
        cfg = hybrid_hf_config(arch, meta, tensor_shapes, _eos_ids(reader), rope_scaling)
        return split_projections(ModelConfig.from_hf_config(cfg))
    if arch == GLM_DSA_GGUF_ARCH:  # MLA + the indexer + the DeepSeek MoE, less the MTP block: as its config.json
        return ModelConfig.from_hf_config(glm_dsa_hf_config(meta, tensor_shapes, _eos_ids(reader)))
    hf_arch = hf_architecture(arch, meta) or GGUF_ARCHITECTURES.get(arch)
    if hf_arch is None:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(sorted(GGUF_ARCHITECTURES))}, "
            f"qwen3, qwen3moe, qwen2moe (and llama with expert_count: Mixtral), {DEEPSEEK_GGUF_ARCH}, "
            f"{GPT_OSS_GGUF_ARCH}, {', '.join(HYBRID_GGUF_ARCHITECTURES)}, {KIMI_GGUF_ARCH}, {GLM_DSA_GGUF_ARCH}"
        )
    rope_scaling = _rope_scaling(reader, arch, set(tensor_shapes))
    hidden = int(_meta(reader, f"{arch}.embedding_length"))
    heads = int(_meta(reader, f"{arch}.attention.head_count"))
    bos = _meta(reader, "tokenizer.ggml.bos_token_id")
    layers, head_dim = int(_meta(reader, f"{arch}.block_count")), _head_dim(reader, arch, hidden, heads)
    return ModelConfig(
        architecture=hf_arch,
        # the embedding's rows are what the weights are shaped by; the token list may be shorter
        vocab_size=tensor_shapes["token_embd.weight"][0],
        hidden_size=hidden,
        intermediate_size=int(_meta(reader, f"{arch}.feed_forward_length")),
        num_hidden_layers=int(_meta(reader, f"{arch}.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(_meta(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=_head_dim(reader, arch, hidden, heads),
        rms_norm_eps=float(_meta(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(_meta(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(_meta(reader, f"{arch}.context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensor_shapes,
        attention_bias=arch == "qwen2" or "blk.0.attn_q.bias" in tensor_shapes,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=_eos_ids(reader),
        qk_norm="blk.0.attn_q_norm.weight" in tensor_shapes,
        moe=gguf_moe_config(arch, meta, set(tensor_shapes), int(_meta(reader, f"{arch}.block_count"))),
        **gemma_gguf_fields(arch, meta, layers, hidden, heads, head_dim),
    )


def llama_rope_row_order(rows: int, num_heads: int) -> np.ndarray:
    """For each HF row of a Llama q/k projection, the GGUF row that holds it.

    llama.cpp stores, per head of width d, HF rows (0, d/2, 1, d/2+1, ...):
    GGUF row h*d + 2*i + j holds HF row h*d + j*d/2 + i (i < d/2, j in {0, 1}).
    """
    if rows % (2 * num_heads) != 0:
        raise ValueError(f"{rows} rows cannot be split into {num_heads} heads of even width")
    half = rows // num_heads // 2
    # [num_heads, half, 2] in GGUF order, read back as [num_heads, 2, half]
    return np.arange(rows).reshape(num_heads, half, 2).swapaxes(1, 2).reshape(-1)


class GGUFSource:
    """WeightSource over a GGUF file, memory-mapped; tensors are dequantized on read."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._reader = GGUFFile(path)
        shapes = {t.name: t.shape for t in self._reader.tensors}
        self.config = gguf_model_config(self._reader, shapes)
        self._arch = _meta(self._reader, "general.architecture")
        self._hybrid = HybridLayout(self._arch, self.config) if self._arch in HYBRID_GGUF_ARCHITECTURES else None
        """The gated-DeltaNet hybrids' moved rows, columns and stored values (gguf_hybrid.py); None otherwise."""
        self._tensors: dict[str, StoredTensor] = {}
        stacks: dict[tuple[int, str, str], StoredTensor] = {}
        for tensor in self._reader.tensors:
            if self._arch == GLM_DSA_GGUF_ARCH and is_nextn_tensor(tensor.name, self.config.num_hidden_layers):
                continue  # GLM-5's multi-token-prediction block: transformers and llama.cpp leave it unused too
            stack = expert_stack(tensor.name) if self._arch == GPT_OSS_GGUF_ARCH else None
            name = None if stack is not None else hf_name(tensor.name, self._arch)
            # MoE / Qwen3 names; a stacked expert tensor gives one view per expert ([out, in] slice of the stack)
            names: list[tuple[str, ExpertIndex | np.ndarray]] = \
                [(name, None)] if name is not None else moe_hf_names(tensor.name, self.config.moe)
            if not names and self._hybrid is not None:  # Qwen3-Next's fused ssm_ba: its b rows and its a rows
                names = self._row_views(tensor.name)
            if not names and stack is None:
                raise ValueError(f"GGUF tensor {tensor.name!r} has no Hugging Face Llama counterpart")
            if tensor.tensor_type not in SUPPORTED_TENSOR_TYPES:
                raise ValueError(
                    f"GGUF tensor {tensor.name!r} has type {tensor.tensor_type.name}, which cannot be "
                    f"dequantized; supported: {', '.join(sorted(t.name for t in SUPPORTED_TENSOR_TYPES))}"
                )
            if stack is not None:  # GPT-OSS's split gate / up / down stacks, joined back under HF's names
                stacks[stack] = tensor
                continue
            rest = tensor.name.split(".", 2)[-1]
            shape = kimi_hf_shape(rest, tensor.shape) if self._arch == KIMI_GGUF_ARCH else None
            if shape is not None:  # Kimi's convolutions, stored [1, C, 1, K]: offered as HF's [C, 1, K]
                tensor = tensor._replace(data=tensor.data.reshape(*shape[:-1], tensor.data.shape[-1]), shape=shape)
            for name, index in names:
                self._tensors[name] = tensor if index is None else _view(tensor, index)
        self._experts = GptOssExpertStacks(stacks) if stacks else None

    def _row_views(self, gguf_name: str) -> list[tuple[str, np.ndarray]]:
        match = _LAYER_RE.fullmatch(gguf_name)
        if match is None:
            return []
        return [(f"model.layers.{match.group(1)}.{rest}", rows)
                for rest, rows in hybrid_row_views(match.group(2), self.config)]

    def names(self) -> list[str]:
        return sorted([*self._tensors, *(self._experts.names() if self._experts else [])])

    def has(self, name: str) -> bool:
        return name in self._tensors or (self._experts is not None and self._experts.has(name))

    def gguf_tensor_type(self, name: str) -> GGMLQuantizationType:
        """Storage type of a tensor (for logging and tests)."""
        return self._lookup(name).tensor_type

    def storage_type(self, name: str) -> str:
        if self._experts is not None and self._experts.has(name):
            return self._experts.storage_type(name)
        stored = self._lookup(name).tensor_type
        if self._column_order(name) is not None and stored not in (_Q.F32, _Q.F16, _Q.BF16):
            return _Q.F32.name  # its columns are moved across blocks: dequantized on read, handed out as floats
        return stored.name

    def _lookup(self, name: str) -> StoredTensor:
        if name not in self._tensors:
            raise KeyError(f"tensor {name!r} is not in {self.path!r}")
        return self._tensors[name]

    def _row_order(self, name: str, rows: int) -> np.ndarray | None:
        """GGUF row of each HF row when llama.cpp reordered them, else None."""
        if self._hybrid is not None:
            return self._hybrid.row_order(name)
        match = _QK_RE.fullmatch(name)
        if self._arch != "llama" or match is None:
            return None
        cfg = self.config
        heads = cfg.num_attention_heads if match.group(1) == "q" else cfg.num_key_value_heads
        return llama_rope_row_order(rows, heads)

    def _column_order(self, name: str) -> np.ndarray | None:
        """GGUF column of each HF column when llama.cpp moved them (a hybrid's out_proj), else None."""
        return None if self._hybrid is None else self._hybrid.column_order(name)

    def get_int4_groups(
        self, name: str, *, dim: int | None = None, start: int = 0, end: int | None = None
    ) -> Int4Groups:
        raw, kind, (lo, hi) = self._group_blocks(name, dim, start, end, INT4_GGUF_TYPES)
        codes, d, m = decode_int4_blocks(raw, kind)
        groups = Int4Groups(codes=torch.from_numpy(codes), d=torch.from_numpy(d), m=torch.from_numpy(m))
        return groups.columns(lo, hi) if (lo, hi) != (0, codes.shape[1]) else groups

    def get_int8_groups(
        self, name: str, *, dim: int | None = None, start: int = 0, end: int | None = None
    ) -> Int8Groups:
        raw, kind, (lo, hi) = self._group_blocks(name, dim, start, end, INT8_GGUF_TYPES)
        codes, d = decode_int8_blocks(raw, kind)
        groups = Int8Groups(codes=torch.from_numpy(codes), d=torch.from_numpy(d))
        return groups.columns(lo, hi) if (lo, hi) != (0, codes.shape[1]) else groups

    def _group_blocks(
        self, name: str, dim: int | None, start: int, end: int | None, kinds: tuple[str, ...]
    ) -> tuple[np.ndarray, str, tuple[int, int]]:
        """The stored blocks of a row or column slice, in HF row order: (raw [rows, bytes], type, the requested
        columns relative to the first block read). A column slice must fall on 32-column boundaries."""
        tensor = self._lookup(name)
        kind = self.storage_type(name)
        shape = tensor.shape  # HF order: (out, in)
        if kind not in kinds or len(shape) != 2:
            raise ValueError(f"{name} is stored as {kind} with shape {shape}; these groups come only from 2-D "
                             f"{', '.join(kinds)} tensors")
        span = resolve_slice(name, shape, dim, start, end)
        order = self._row_order(name, shape[0])  # whole rows of blocks, so reordering them is free
        rows = np.arange(shape[0]) if order is None else order
        lo, hi = 0, shape[1]
        if span is not None and span[0] == 0:
            rows = rows[span[1] : span[2]]
        elif span is not None:
            lo, hi = span[1], span[2]
            if lo % QUANT_GROUP or hi % QUANT_GROUP:
                raise ValueError(f"{name}: columns [{lo}:{hi}) do not fall on {QUANT_GROUP}-column group boundaries")
        # read only the blocks that cover columns [lo, hi) (a Q4_K block spans 256 columns)
        per_block, size = block_values(kind), block_bytes(kind)
        first, last = lo // per_block, -(-hi // per_block)
        raw = np.asarray(tensor.data[rows, first * size : last * size])
        base = first * per_block
        return raw, kind, (lo - base, hi - base)

    def get(
        self,
        name: str,
        *,
        dim: int | None = None,
        start: int = 0,
        end: int | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        if self._experts is not None and self._experts.has(name):
            return self._experts.get(name, dim=dim, start=start, end=end, dtype=dtype)
        tensor = self._lookup(name)
        shape = tensor.shape  # HF order: (out, in)
        span = resolve_slice(name, shape, dim, start, end)
        columns = self._column_order(name)
        if columns is not None:  # read the rows asked for, whole, then gather the HF columns
            columns = columns if span is None or span[0] == 0 else columns[span[1] : span[2]]
            span = span if span is None or span[0] == 0 else None
        out = _read(tensor, shape, span, self._row_order(name, shape[0]))
        if columns is not None:
            out = out[:, columns]
        if self._arch in GEMMA_GGUF_ARCHITECTURES and stores_one_plus_w(name):
            out = out - np.float32(1)  # llama.cpp stored 1 + w (cpllm/model/loaders/gguf_gemma.py)
        if self._hybrid is not None:
            out = self._hybrid.values(name, out)  # 1 + w, -exp(A_log), the squeezed conv axis (gguf_hybrid.py)
        if self._arch == KIMI_GGUF_ARCH:
            out = kimi_values(name, out)  # -exp(A_log) (gguf_kimi.py)
        if not (out.flags.owndata and out.flags.writeable and out.flags.c_contiguous):
            out = np.array(out)  # detach from the read-only memory map
        return torch.from_numpy(out).to(dtype)


def _view(tensor: StoredTensor, index: ExpertIndex | np.ndarray) -> StoredTensor:
    """Part of a stored tensor as a tensor of its own: an expert of a stack (int), rows of an expert ((int, slice))
    or rows (an index array, copied: a small tensor). Its rows stay whole blocks, so any storage type slices."""
    if isinstance(index, np.ndarray):
        return tensor._replace(data=np.ascontiguousarray(tensor.data[index]), shape=(len(index), *tensor.shape[1:]))
    if isinstance(index, tuple):
        expert, rows = index
        return tensor._replace(data=tensor.data[expert, rows], shape=(rows.stop - rows.start, *tensor.shape[2:]))
    return tensor._replace(data=tensor.data[index], shape=tensor.shape[1:])


def _read(
    tensor: StoredTensor,
    shape: tuple[int, ...],
    span: tuple[int, int, int] | None,
    row_order: np.ndarray | None,
) -> np.ndarray:
    """Dequantize `span` of `tensor` (HF layout), touching as few stored blocks as the layout allows."""
    qtype = tensor.tensor_type
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    # element types are stored as elements, the others as bytes along the last axis
    unit, unit_bytes = (block, block_bytes) if tensor.data.dtype == np.uint8 else (1, 1)
    last = len(shape) - 1
    index: list[Any] = [slice(None)] * len(shape)
    after: list[Any] = [slice(None)] * len(shape)  # applied to the dequantized values
    if row_order is not None and last > 0:
        index[0] = row_order  # rows are whole blocks, so reordering them is free
    elif row_order is not None:
        after[0] = row_order  # a 1-D q/k bias: reorder the dequantized values
    out_shape = list(shape)
    if span is not None:
        d, lo, hi = span
        out_shape[d] = hi - lo
        if d < last:
            index[d] = index[d][lo:hi] if isinstance(index[d], np.ndarray) else slice(lo, hi)
        elif lo % unit == 0 and hi % unit == 0 and isinstance(after[d], slice):
            index[d] = slice(lo // unit * unit_bytes, hi // unit * unit_bytes)
        else:  # the span cuts a block: dequantize whole blocks, then slice
            after[d] = np.arange(shape[d])[after[d]][lo:hi]
    raw = tensor.data[tuple(index)]
    if raw.size == 0:
        return np.zeros(out_shape, dtype=np.float32)
    values = dequantize(raw, qtype).reshape(*raw.shape[:-1], -1)
    if any(not isinstance(a, slice) for a in after):
        values = values[tuple(after)]
    return values
