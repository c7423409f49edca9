"""llama.cpp's `gpt-oss` GGUF architecture (GPT-OSS 20B / 120B): its metadata read back into a config.json
dictionary, its tensor names mapped onto Hugging Face's, and its split expert stacks offered under the names and
layout of the released safetensors checkpoints, so cpllm/model/families/gpt_oss.py loads either file unchanged.

What llama.cpp's converter does to a GPT-OSS checkpoint, and how reading undoes it:
- names: `attn_sinks.weight` (the per-head sinks), `post_attention_norm`, the router as `ffn_gate_inp` (weight
  and bias), `attn_output.bias`; the rest as for Llama. q / k rows are not reordered (rotate-half rotary).
- experts: HF's `gate_up_proj` interleaves gate and up along its output (gate = even rows, up = odd ones, in
  [out, in] order); the converter splits them into `ffn_gate_exps` and `ffn_up_exps` ([E, I, hidden] each, as
  are their `.bias` [E, I]), and writes `ffn_down_exps` [E, hidden, I]. Reading interleaves them back.
- MXFP4 (GGML type 39): each block of 32 weights is 17 bytes, the E8M0 scale byte first (the same byte as HF's
  `*_scales`, 2^(s - 127)), then 16 bytes whose low nibbles are elements 0..15 and high nibbles elements 16..31
  (HF packs elements 2j / 2j+1 into byte j). `hf_mxfp4_blocks` moves the nibbles back, so the blocks are the
  checkpoint's own: dequantized exactly at load, or run as their exact 8-bit form under `auto`
  (cpllm/model/moe/gpt_oss_block.py). Experts stored in another type (F16, Q8_0, ...) are dequantized to floats.
- metadata: the window in `attention.sliding_window`; which layers slide is llama.cpp's own rule for this
  architecture (every second layer, the even ones, as transformers' default `layer_types`) unless
  `attention.sliding_window_pattern` says; YaRN in `rope.scaling.*`. llama.cpp keeps the SwiGLU constants in code
  (alpha 1.702, limit 7.0); a file may carry the limit in `swiglu_clamp_exp` (one value per layer, all equal).
  YaRN's ramp is read untruncated, as the model's config.json has it (`truncate: false`) and transformers runs it.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from cpllm.model.loaders.gguf_file import StoredTensor, arch_meta
from cpllm.model.loaders.weight_slices import resolve_slice
from cpllm.model.formats.mxfp4 import BLOCK

GPT_OSS_GGUF_ARCH = "gpt-oss"
SWIGLU_LIMIT = 7.0
"""llama.cpp's clamp for this architecture when the file names none (the released models' swiglu_limit)."""
_MXFP4 = GGMLQuantizationType.MXFP4
_BLOCK_BYTES = 1 + BLOCK // 2

_LAYER_NAMES = {
    "attn_sinks.weight": "self_attn.sinks",
    "attn_sinks": "self_attn.sinks",
    "attn_output.bias": "self_attn.o_proj.bias",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate_inp.weight": "mlp.router.weight",
    "ffn_gate_inp.bias": "mlp.router.bias",
}
_STACK_RE = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.(weight|bias)")
_REQUIRED = ("attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_output.bias", "ffn_gate_inp.weight",
             "ffn_gate_inp.bias", *(f"ffn_{p}_exps.{k}" for p in ("gate", "up", "down") for k in ("weight", "bias")))
"""Tensors every layer of a gpt-oss file holds besides the sinks (checked at open, so a broken file is named)."""


def gpt_oss_layer_name(rest: str) -> str | None:
    """The HF name (after `model.layers.N.`) of a gpt-oss layer tensor whose name differs from Llama's, or None."""
    return _LAYER_NAMES.get(rest)


def expert_stack(gguf_name: str) -> tuple[int, str, str] | None:
    """(layer, "gate" | "up" | "down", "weight" | "bias") of a stacked expert tensor, else None."""
    match = _STACK_RE.fullmatch(gguf_name)
    return None if match is None else (int(match.group(1)), match.group(2), match.group(3))


def _check_tensors(layers: int, names: set[str]) -> None:
    for i in range(layers):
        if not ({f"blk.{i}.attn_sinks.weight", f"blk.{i}.attn_sinks"} & names):
            raise ValueError(f"gpt-oss GGUF file lacks blk.{i}.attn_sinks.weight: every GPT-OSS layer has "
                             "per-head attention sinks")
        missing = [f"blk.{i}.{rest}" for rest in _REQUIRED if f"blk.{i}.{rest}" not in names]
        if missing:
            raise ValueError(f"gpt-oss GGUF file lacks {', '.join(missing)} (block_count={layers})")


def _check_shapes(tensor_shapes: dict[str, tuple[int, ...]], layers: int, experts: int, width: int, hidden: int,
                  heads: int) -> None:
    """Each layer's stacks and sinks against the metadata: [E, I, hidden] gate / up, [E, hidden, I] down, [H] sinks."""
    for i in range(layers):
        want = {f"blk.{i}.ffn_gate_exps.weight": (experts, width, hidden),
                f"blk.{i}.ffn_up_exps.weight": (experts, width, hidden),
                f"blk.{i}.ffn_down_exps.weight": (experts, hidden, width)}
        sinks = f"blk.{i}.attn_sinks.weight" if f"blk.{i}.attn_sinks.weight" in tensor_shapes else f"blk.{i}.attn_sinks"
        want[sinks] = (heads,)
        for name, shape in want.items():
            if tuple(tensor_shapes[name]) != shape:
                raise ValueError(f"gpt-oss GGUF tensor {name} has shape {tuple(tensor_shapes[name])}; the metadata "
                                 f"(expert_count={experts}, expert_feed_forward_length={width}, "
                                 f"embedding_length={hidden}, head_count={heads}) needs {shape}")


def _layer_types(meta: Callable[[str, Any], Any], layers: int) -> list[str]:
    """llama.cpp's pattern for gpt-oss: n = 2 (layer i slides iff i % n < n - 1: the even layers), or the file's
    `sliding_window_pattern` (a number n, or one bool per layer)."""
    pattern = meta(f"{GPT_OSS_GGUF_ARCH}.attention.sliding_window_pattern", 2)
    if isinstance(pattern, (list, tuple)):
        if len(pattern) != layers:
            raise ValueError(f"gpt-oss attention.sliding_window_pattern has {len(pattern)} entries; "
                             f"block_count={layers}")
        slides = [bool(p) for p in pattern]
    else:
        n = int(pattern)
        slides = [n == 0 or i % n < n - 1 for i in range(layers)]
    return ["sliding_attention" if s else "full_attention" for s in slides]


def _swiglu_limit(meta: Callable[[str, Any], Any], layers: int) -> float:
    limits = meta(f"{GPT_OSS_GGUF_ARCH}.swiglu_clamp_exp", None)
    if limits is None:
        return SWIGLU_LIMIT
    values = sorted({float(v) for v in (limits if isinstance(limits, (list, tuple)) else [limits] * layers)})
    if len(values) != 1 or values[0] <= 0:
        raise ValueError(f"gpt-oss swiglu_clamp_exp={limits!r}: one positive limit shared by every layer is supported")
    return values[0]


def gpt_oss_hf_config(meta: Callable[[str, Any], Any], tensor_shapes: dict[str, tuple[int, ...]],
                      eos_ids: tuple[int, ...], rope_scaling: dict[str, Any] | None) -> dict[str, Any]:
    """The config.json dictionary of a gpt-oss GGUF file (see the module); `rope_scaling` as the shared GGUF
    reader gives it (none, linear or yarn, any other type refused there with its name)."""
    m = arch_meta(meta, GPT_OSS_GGUF_ARCH, "GPT-OSS")

    layers, heads = int(m("block_count", required=True)), int(m("attention.head_count", required=True))
    _check_tensors(layers, set(tensor_shapes))
    head_dim = int(m("attention.key_length", int(m("embedding_length", required=True)) // heads))
    if int(m("attention.value_length", head_dim)) != head_dim:
        raise ValueError(f"gpt-oss attention.key_length={head_dim} differs from "
                         f"value_length={m('attention.value_length')}; not supported")
    if rope_scaling is not None and rope_scaling.get("rope_type") == "yarn":
        rope_scaling = {**rope_scaling, "truncate": False}
    bos = meta("tokenizer.ggml.bos_token_id", None)
    hidden, experts = int(m("embedding_length")), int(m("expert_count", required=True))
    width = int(m("expert_feed_forward_length", None) or m("feed_forward_length", required=True))
    _check_shapes(tensor_shapes, layers, experts, width, hidden, heads)
    return dict(
        architectures=["GptOssForCausalLM"], vocab_size=tensor_shapes["token_embd.weight"][0], hidden_size=hidden,
        intermediate_size=width, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=int(m("attention.head_count_kv", heads)), head_dim=head_dim,
        rms_norm_eps=float(m("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(m("rope.freq_base", 150000.0)), rope_scaling=rope_scaling,
        max_position_embeddings=int(m("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensor_shapes, attention_bias=True,
        sliding_window=int(m("attention.sliding_window", required=True)), layer_types=_layer_types(meta, layers),
        num_local_experts=experts, num_experts_per_tok=int(m("expert_used_count", required=True)),
        swiglu_limit=_swiglu_limit(meta, layers),
        bos_token_id=None if bos is None else int(bos), eos_token_id=list(eos_ids),
    )


def hf_mxfp4_blocks(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """GGUF MXFP4 rows [..., G * 17] (uint8) -> HF (blocks [..., G, 16], scales [..., G]): the scale byte split
    off, and the nibbles moved from llama.cpp's order (byte j: elements j, j + 16) to HF's (byte j: 2j, 2j + 1)."""
    if raw.shape[-1] % _BLOCK_BYTES:
        raise ValueError(f"MXFP4 rows of {raw.shape[-1]} bytes are not whole {_BLOCK_BYTES}-byte blocks")
    blocks = raw.reshape(*raw.shape[:-1], raw.shape[-1] // _BLOCK_BYTES, _BLOCK_BYTES)
    scales, packed = blocks[..., 0], blocks[..., 1:]
    codes = np.concatenate((packed & 0x0F, packed >> 4), axis=-1)  # [..., G, 32] in element order
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8), np.ascontiguousarray(scales)


def _interleave(gate: np.ndarray, up: np.ndarray, axis: int) -> np.ndarray:
    """HF's gate_up order along `axis`: gate row r at 2r, up row r at 2r + 1."""
    out = np.stack((gate, up), axis=axis + 1)
    return out.reshape(*gate.shape[:axis], 2 * gate.shape[axis], *gate.shape[axis + 1:])


class GptOssExpertStacks:
    """The HF expert names of every layer (`mlp.experts.gate_up_proj[_bias|_blocks|_scales]`, likewise
    down_proj) over the file's split stacks; a dim-0 slice (experts) reads only those experts' bytes."""

    def __init__(self, stacks: dict[tuple[int, str, str], StoredTensor]) -> None:
        self._stacks = stacks
        self._shapes: dict[str, tuple[tuple[int, ...], int, str]] = {}  # HF name -> (shape, layer, what)
        for layer in sorted({key[0] for key in stacks}):
            gate, up, down = (stacks[(layer, p, "weight")] for p in ("gate", "up", "down"))
            (e, rows, hidden), width = gate.shape, down.shape[-1]
            prefix = f"model.layers.{layer}.mlp.experts"
            self._shapes[f"{prefix}.gate_up_proj_bias"] = ((e, 2 * rows), layer, "gate_up_bias")
            self._shapes[f"{prefix}.down_proj_bias"] = ((e, hidden), layer, "down_bias")
            if gate.tensor_type == up.tensor_type == _MXFP4:
                self._shapes[f"{prefix}.gate_up_proj_blocks"] = ((e, 2 * rows, hidden // BLOCK, 16), layer, "gu_b")
                self._shapes[f"{prefix}.gate_up_proj_scales"] = ((e, 2 * rows, hidden // BLOCK), layer, "gu_s")
            else:
                self._shapes[f"{prefix}.gate_up_proj"] = ((e, hidden, 2 * rows), layer, "gate_up")
            if down.tensor_type == _MXFP4:
                self._shapes[f"{prefix}.down_proj_blocks"] = ((e, hidden, width // BLOCK, 16), layer, "down_b")
                self._shapes[f"{prefix}.down_proj_scales"] = ((e, hidden, width // BLOCK), layer, "down_s")
            else:
                self._shapes[f"{prefix}.down_proj"] = ((e, width, hidden), layer, "down")

    def names(self) -> list[str]:
        return list(self._shapes)

    def has(self, name: str) -> bool:
        return name in self._shapes

    def storage_type(self, name: str) -> str:
        _, layer, what = self._shapes[name]
        return self._stacks[(layer, "down" if what.startswith("down") else "gate", "weight")].tensor_type.name

    def _values(self, layer: int, part: str, kind: str, lo: int, hi: int) -> np.ndarray:
        """Experts [lo, hi) of one stored stack, dequantized to float32 in its stored [E, out, in] shape."""
        tensor = self._stacks[(layer, part, kind)]
        values = dequantize(np.asarray(tensor.data[lo:hi]), tensor.tensor_type)
        return np.array(values, dtype=np.float32).reshape(hi - lo, *tensor.shape[1:])  # owned: off the read-only map

    def _mxfp4(self, layer: int, part: str, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        return hf_mxfp4_blocks(np.asarray(self._stacks[(layer, part, "weight")].data[lo:hi]))

    def _build(self, layer: int, what: str, lo: int, hi: int) -> np.ndarray:
        """Experts [lo, hi) of one HF tensor."""
        if what in ("gate_up_bias", "gate_up"):
            kind = "bias" if what == "gate_up_bias" else "weight"
            gate_up = _interleave(self._values(layer, "gate", kind, lo, hi), self._values(layer, "up", kind, lo, hi), 1)
            return gate_up if kind == "bias" else np.ascontiguousarray(gate_up.transpose(0, 2, 1))  # [E, in, 2I]
        if what == "down_bias":
            return self._values(layer, "down", "bias", lo, hi)
        if what == "down":
            return np.ascontiguousarray(self._values(layer, "down", "weight", lo, hi).transpose(0, 2, 1))
        if what.startswith("down"):
            return self._mxfp4(layer, "down", lo, hi)[what == "down_s"]
        part = what == "gu_s"  # 0: the blocks, 1: the scales
        return _interleave(self._mxfp4(layer, "gate", lo, hi)[part], self._mxfp4(layer, "up", lo, hi)[part], 1)

    def get(self, name: str, *, dim: int | None = None, start: int = 0, end: int | None = None,
            dtype: torch.dtype = torch.float32) -> torch.Tensor:
        shape, layer, what = self._shapes[name]
        span = resolve_slice(name, shape, dim, start, end)
        lo, hi = (span[1], span[2]) if span is not None and span[0] == 0 else (0, shape[0])
        out = torch.from_numpy(self._build(layer, what, lo, hi))
        if span is not None and span[0] != 0:
            out = out.narrow(span[0], span[1], span[2] - span[1])
        return out.to(dtype)
