"""Tiny random Llama / Qwen2 models for tests, built on the spot (nothing is downloaded).

Helpers (all deterministic for a given seed):

- `make_tiny_hf_model(arch, seed=, **config)`: an in-memory transformers model
  (the reference to compare an engine against);
- `save_tiny_hf_model(folder, arch, seed=, max_shard_size=, **config)`: the same
  model as a Hugging Face folder: config.json, *.safetensors (sharded on
  request), generation_config.json, tokenizer.json / tokenizer_config.json with
  a ChatML chat template;
- `save_tiny_gguf(path, arch, seed=, tensor_types=, raw_tensors=, **config)`:
  the same model as a GGUF file, or `write_tiny_gguf(path, config, state_dict)`
  for given weights. Written with gguf.GGUFWriter the way llama.cpp's converter
  does it: llama.cpp tensor names, Llama q/k rows reordered for llama.cpp's
  interleaved rotary, block-quantized tensors, and a gpt2-style BPE vocabulary
  in the metadata, so transformers can load it too (`gguf_file=`). Returns the
  dequantized weights a correct reader must produce (HF names and layout);
- `tiny_vocab()`, `tiny_hf_tokenizer()`, `tiny_hf_config(arch, **config)`.

`arch` is "llama" or "qwen2" (q/k/v biases). All models share one tiny
byte-level BPE vocabulary (`tiny_vocab`): three special tokens
(<|endoftext|> 0, <|im_start|> 1 = bos, <|im_end|> 2 = eos), the 256 byte
symbols, and merges for a handful of words, so any text round-trips.

Default shapes: vocab 300, hidden 64, 4 query heads and 2 KV heads of width
16, MLP 128, 2 layers, 256 positions, rope_theta 50000, untied; every input
width is a multiple of 32, the block of Q8_0 / Q4_0 / Q4_1. Override any
Hugging Face config field by keyword (e.g. tie_word_embeddings=True).

Attention is sharpened: q_proj and k_proj weights are scaled by QK_SCALE after
the default init, which otherwise leaves attention nearly uniform (scores of
std ~0.03) and so hides position, mask and merge bugs. With the scale the
attention rows of a 37-token prompt have a mean max probability of ~0.65
(uniform: ~0.12) while the logits stay small and the greedy tokens varied.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QType
from gguf.quants import dequantize, quantize

TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML, like SmolLM2's template without its default system prompt."""

_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_MERGE_WORDS = (
    "Ġthe", "Ġhello", "hello", "Ġworld", "Ġcat", "Ġsat", "Ġon", "Ġmat",
    "ing", "Ġis", "Ġof", "Ġand", "Ġto", "Ġin", "Ġa", "ĠThe",
)  # fmt: skip
_CONTROL, _NORMAL = 3, 1  # llama.cpp token types
QK_SCALE = 12.0
"""Factor on the random q_proj / k_proj weights: attention scores of std ~3.7 instead of ~0.03 (peaked rows)."""

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
"""Short names accepted by the builders -> Hugging Face architecture."""


@dataclass(frozen=True)
class TinyVocab:
    """A byte-level BPE vocabulary in the form GGUF stores it."""

    tokens: tuple[str, ...]
    """Token strings in id order (byte symbols spelled as GPT-2 does, 'Ġ' for a space)."""
    token_types: tuple[int, ...]
    """llama.cpp token type per id: 3 = control (special), 1 = normal."""
    merges: tuple[str, ...]
    """BPE merges "left right", highest priority first."""
    bos_token_id: int
    """`<|im_start|>`, as in SmolLM2."""
    eos_token_id: int
    """`<|im_end|>`."""
    pad_token_id: int
    """`<|endoftext|>`."""


def _byte_symbols() -> list[str]:
    """GPT-2's printable stand-in for each byte value 0..255."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols, extra = {}, 0
    for b in range(256):
        if b in printable:
            symbols[b] = chr(b)
        else:  # bytes without a printable glyph map past 255, in order
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


@functools.cache
def tiny_vocab() -> TinyVocab:
    """The shared tiny vocabulary: specials, 256 byte symbols, then one token per merge."""
    tokens = [*_SPECIAL_TOKENS, *_byte_symbols()]
    known, merges = set(tokens), []
    for word in _MERGE_WORDS:
        piece = word[0]
        for char in word[1:]:  # merge left to right: "Ġh e", "Ġhe l", ...
            merged = piece + char
            if merged not in known:
                merges.append(f"{piece} {char}")
                tokens.append(merged)
                known.add(merged)
            piece = merged
    types = [_CONTROL] * len(_SPECIAL_TOKENS) + [_NORMAL] * (len(tokens) - len(_SPECIAL_TOKENS))
    return TinyVocab(
        tokens=tuple(tokens), token_types=tuple(types), merges=tuple(merges),
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip


def tiny_hf_tokenizer():
    """A transformers fast tokenizer over `tiny_vocab()`, with TINY_CHAT_TEMPLATE."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = tiny_vocab()
    bpe = models.BPE(
        vocab={token: i for i, token in enumerate(vocab.tokens)},
        merges=[tuple(m.split(" ")) for m in vocab.merges],
    )
    raw = Tokenizer(bpe)
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.add_special_tokens(list(_SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=raw,
        bos_token=vocab.tokens[vocab.bos_token_id],
        eos_token=vocab.tokens[vocab.eos_token_id],
        pad_token=vocab.tokens[vocab.pad_token_id],
        chat_template=TINY_CHAT_TEMPLATE,
    )


def tiny_hf_config(architecture: str = "llama", **overrides: Any):
    """A transformers LlamaConfig / Qwen2Config of the tiny default shape, with `overrides` applied."""
    from transformers import LlamaConfig, Qwen2Config

    vocab = tiny_vocab()
    fields: dict[str, Any] = dict(
        vocab_size=len(vocab.tokens),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=50000.0,
        tie_word_embeddings=False,
        bos_token_id=vocab.bos_token_id,
        eos_token_id=vocab.eos_token_id,
        pad_token_id=vocab.pad_token_id,
    )
    fields.update(overrides)
    if architecture == "llama":
        return LlamaConfig(**fields)
    if architecture == "qwen2":
        return Qwen2Config(**fields)
    raise ValueError(f"unknown tiny architecture {architecture!r}; choose one of {sorted(ARCHITECTURES)}")


def make_tiny_hf_model(architecture: str = "llama", *, seed: int = 0, **overrides: Any):
    """A random transformers LlamaForCausalLM / Qwen2ForCausalLM (float32, eval mode).

    Norm weights and biases are randomized too (HF initializes them to ones /
    zeros), so a test notices when one is dropped or swapped; q_proj / k_proj
    weights are scaled by QK_SCALE so attention is peaked, not near uniform.
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_hf_config(architecture, **overrides), dtype=torch.float32)
    return randomize_weights(model, seed)


def randomize_weights(model, seed: int, extra: Callable[[str, torch.Tensor, torch.Generator], None] | None = None):
    """Randomize norms and biases, sharpen attention (q/k x QK_SCALE), then let `extra` set family-specific
    parameters, drawing from one generator seeded with `seed`; returns the model in eval mode."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))
            elif name.endswith(".bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
            if name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
                param.mul_(QK_SCALE)
            if extra is not None:
                extra(name, param, generator)
    return model.eval()


def save_tiny_hf_model(
    folder: str, architecture: str = "llama", *, seed: int = 0, max_shard_size: str | None = None, **overrides: Any
) -> str:
    """Write a random tiny model as a Hugging Face folder and return the folder.

    `max_shard_size` (e.g. "20KB") splits the safetensors into several shards
    with a model.safetensors.index.json.
    """
    os.makedirs(folder, exist_ok=True)
    model = make_tiny_hf_model(architecture, seed=seed, **overrides)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(folder, **kwargs)
    tiny_hf_tokenizer().save_pretrained(folder)
    return folder


def save_random_hf_folder(config, folder: str) -> str:
    """A benchmark-sized random model of `config` (seed 0, every weight but the norms drawn from N(0, 0.02), norms
    ones) written as a Hugging Face folder with the tiny tokenizer; an existing folder is reused as it is."""
    from transformers import AutoModelForCausalLM

    if os.path.exists(os.path.join(folder, "config.json")):
        return folder
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not name.endswith("norm.weight"):
                param.normal_(0.0, 0.02)
    model.save_pretrained(folder)
    tiny_hf_tokenizer().save_pretrained(folder)
    return folder


# --- GGUF ---------------------------------------------------------------------------------

_GGUF_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_GGUF_LAYER = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}  # fmt: skip


def gguf_tensor_name(hf_name: str) -> str:
    """llama.cpp's name for a Hugging Face Llama tensor name."""
    if hf_name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)  # model.layers.{i}.{module}.{weight|bias}
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_GGUF_LAYER[module]}.{kind}"


def default_gguf_tensor_type(hf_name: str) -> QType:
    """A mix that covers F32, F16, BF16, Q8_0, Q4_0 and Q4_1; 1-D tensors stay F32 as in llama.cpp."""
    table = {
        "embed_tokens": QType.Q8_0, "q_proj.weight": QType.Q4_0, "k_proj.weight": QType.Q4_1,
        "v_proj.weight": QType.Q8_0, "o_proj.weight": QType.F16, "gate_proj": QType.Q4_1,
        "up_proj": QType.Q4_0, "down_proj": QType.BF16, "lm_head": QType.Q8_0,
    }  # fmt: skip
    for key, qtype in table.items():
        if key in hf_name:
            return qtype
    return QType.F32


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter step for Llama q/k: per head, rows (0..d/2-1, d/2..d-1) -> interleaved pairs."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return weight.reshape(num_heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def add_tiny_tokenizer(writer: gguf.GGUFWriter, vocab: TinyVocab | None = None, chat_template: bool = True) -> None:
    """The tiny BPE vocabulary (and its chat template) as GGUF tokenizer metadata."""
    vocab = tiny_vocab() if vocab is None else vocab
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(list(vocab.tokens))
    writer.add_token_types(list(vocab.token_types))
    writer.add_token_merges(list(vocab.merges))
    writer.add_bos_token_id(vocab.bos_token_id)
    writer.add_eos_token_id(vocab.eos_token_id)
    writer.add_pad_token_id(vocab.pad_token_id)
    writer.add_add_bos_token(False)
    if chat_template:
        writer.add_chat_template(TINY_CHAT_TEMPLATE)


def _add_metadata(writer: gguf.GGUFWriter, config: Any, vocab: TinyVocab) -> None:
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(config.head_dim)
    _add_rope_scaling(writer, config.rope_parameters)
    writer.add_vocab_size(config.vocab_size)
    add_tiny_tokenizer(writer, vocab)


def _add_rope_scaling(writer: gguf.GGUFWriter, params: Mapping[str, Any]) -> None:
    """linear and yarn scaling as llama.cpp's converter writes them (type, factor, yarn's original length)."""
    kind = params.get("rope_type", "default")
    if kind not in ("linear", "yarn"):
        return
    writer.add_rope_scaling_type(gguf.RopeScalingType(kind))
    writer.add_rope_scaling_factor(float(params["factor"]))
    if kind == "yarn":
        writer.add_rope_scaling_orig_ctx_len(int(params["original_max_position_embeddings"]))


def write_tiny_gguf(
    path: str,
    config: Any,
    state_dict: Mapping[str, torch.Tensor],
    *,
    architecture: str = "llama",
    tensor_types: Mapping[str, QType] | Callable[[str], QType] | None = None,
    raw_tensors: Mapping[str, tuple[np.ndarray, QType | None]] | None = None,
) -> dict[str, torch.Tensor]:
    """Write HF-named weights as a llama.cpp-style GGUF file; return what a correct reader must give back.

    config: the transformers config the weights belong to (shapes, rope base, eps).
    state_dict: Hugging Face names -> tensors; `lm_head.weight` is skipped when the
        config ties embeddings (so the file has no `output.weight`, as llama.cpp writes it).
    tensor_types: storage type per HF name (a mapping, missing names -> F32, or a
        function); default `default_gguf_tensor_type`.
    raw_tensors: GGUF name -> (array, raw type or None) written verbatim instead of the
        converted weight of that name (for broken or exotic files); their reference is
        plain dequantization, without the q/k reordering.
    Returns: HF name -> float32 tensor, the dequantized stored values in HF layout.
    """
    pick = tensor_types if callable(tensor_types) else None
    if pick is None:
        table = tensor_types
        pick = default_gguf_tensor_type if table is None else (lambda n: table.get(n, QType.F32))
    raw_tensors = dict(raw_tensors or {})
    writer = gguf.GGUFWriter(path, architecture)
    _add_metadata(writer, config, tiny_vocab())
    reference: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        gname = gguf_tensor_name(name)
        if gname in raw_tensors:
            data, raw_type = raw_tensors.pop(gname)
            writer.add_tensor(gname, data, raw_dtype=raw_type)
            qtype = raw_type or gguf.GGMLQuantizationType.F32
            reference[name] = torch.from_numpy(np.array(dequantize(data, qtype), dtype=np.float32))
            continue
        weight = tensor.detach().to(torch.float32).numpy()
        qtype = pick(name)
        stored = quantize(weight, qtype)
        # quantizing acts on whole rows, so it commutes with the q/k row reordering below
        reference[name] = torch.from_numpy(np.array(dequantize(stored, qtype), dtype=np.float32))
        heads = _permute_heads(name, config) if architecture == "llama" else None
        if heads is not None:
            stored = llama_cpp_permute(stored, heads)
        writer.add_tensor(gname, stored, raw_dtype=None if qtype in (QType.F32, QType.F16) else qtype)
    for gname, (data, raw_type) in raw_tensors.items():  # extra tensors with no HF counterpart
        writer.add_tensor(gname, data, raw_dtype=raw_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return reference


def _permute_heads(hf_name: str, config: Any) -> int | None:
    if ".self_attn.q_proj." in hf_name:
        return config.num_attention_heads
    if ".self_attn.k_proj." in hf_name:
        return config.num_key_value_heads
    return None


def save_tiny_gguf(
    path: str,
    architecture: str = "llama",
    *,
    seed: int = 0,
    tensor_types: Mapping[str, QType] | Callable[[str], QType] | None = None,
    raw_tensors: Mapping[str, tuple[np.ndarray, QType | None]] | None = None,
    **overrides: Any,
) -> dict[str, torch.Tensor]:
    """Build a random tiny model and write it to `path` as GGUF (see write_tiny_gguf).

    Returns the reference weights (HF names, HF layout, dequantized). The
    unquantized model is `make_tiny_hf_model(architecture, seed=seed, **overrides)`.
    """
    model = make_tiny_hf_model(architecture, seed=seed, **overrides)
    return write_tiny_gguf(
        path, model.config, model.state_dict(),
        architecture=architecture, tensor_types=tensor_types, raw_tensors=raw_tensors,
    )  # fmt: skip
