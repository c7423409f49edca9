"""One interface over model weight files: a Hugging Face folder or a GGUF file.

Every source hands out tensors under Hugging Face Llama names and in Hugging
Face layout, so the model code never knows which file format it came from:

    model.embed_tokens.weight                       [vocab, hidden]
    model.layers.{i}.self_attn.{q,k,v,o}_proj.weight  (out, in)
    model.layers.{i}.self_attn.{q,k,v}_proj.bias      (Qwen2)
    model.layers.{i}.mlp.{gate,up,down}_proj.weight
    model.layers.{i}.self_attn.{q,k}_norm.weight      (Qwen3, Gemma3)
    model.layers.{i}.mlp.gate.weight                  (MoE router; Mixtral: block_sparse_moe.gate)
    model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight   (one per expert; Mixtral: w1, w3, w2)
    model.layers.{i}.mlp.shared_expert.{gate,up,down}_proj.weight, mlp.shared_expert_gate.weight  (Qwen2-MoE)
    model.layers.{i}.input_layernorm.weight
    model.layers.{i}.post_attention_layernorm.weight
    model.layers.{i}.{pre,post}_feedforward_layernorm.weight  (Gemma2, Gemma3; a GGUF file's 1 + w undone)
    model.norm.weight
    lm_head.weight                                  (absent when tied to the embedding)

`get(name, dim=, start=, end=)` returns only a slice along one dimension, so a
tensor-parallel rank reads its shard without holding every shard at once.
`storage_type(name)` says how a tensor is stored, and `get_int4_groups` /
`get_int8_groups` hand out a GGUF file's Q4 / Q8_0 blocks as codes and scales, so
they run as stored (cpllm/model/formats/plan.py decides which weights do).
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from cpllm.config.engine import ModelConfig

if TYPE_CHECKING:
    from cpllm.model.formats.groups import Int4Groups, Int8Groups


@runtime_checkable
class WeightSource(Protocol):
    """Read access to one model's weights, by Hugging Face tensor name."""

    config: ModelConfig

    def names(self) -> list[str]:
        """Every tensor name the source holds, in Hugging Face Llama naming."""
        ...

    def get(
        self,
        name: str,
        *,
        dim: int | None = None,
        start: int = 0,
        end: int | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """The tensor in HF layout, or its slice [start:end) along `dim`, as `dtype`."""
        ...

    def has(self, name: str) -> bool:
        """Whether `name` is one of `names()`."""
        ...

    def storage_type(self, name: str) -> str:
        """How the tensor is stored: a GGUF type name ("Q4_1", "Q8_0", "F32", ...) or a safetensors dtype
        name, which uses the same spelling for floats ("F32", "F16", "BF16")."""
        ...

    def get_int4_groups(
        self, name: str, *, dim: int | None = None, start: int = 0, end: int | None = None
    ) -> "Int4Groups":
        """A 4-bit stored weight (GGUF Q4_0 / Q4_1 / Q4_K) in HF layout as codes and per-32 scales, without
        dequantizing; a column slice must fall on 32-column boundaries. Other storage raises ValueError."""
        ...

    def get_int8_groups(
        self, name: str, *, dim: int | None = None, start: int = 0, end: int | None = None
    ) -> "Int8Groups":
        """As get_int4_groups, for a weight stored as GGUF Q8_0."""
        ...


def open_weights(path: str) -> WeightSource:
    """Open a Hugging Face folder (config.json + *.safetensors) or a .gguf file.

    The driver reads the config before the engine starts and loads the weights right after; opening a GGUF
    file parses all its metadata (seconds for a real vocabulary), so a source is reused while the file is
    unchanged."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path {path!r} does not exist")
    return _open_unchanged(os.path.realpath(path), os.stat(path).st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _open_unchanged(path: str, mtime_ns: int) -> WeightSource:
    if os.path.isdir(path):
        from cpllm.model.loaders.safetensors_source import SafetensorsSource

        return SafetensorsSource(path)
    if os.path.isfile(path) and path.endswith(".gguf"):
        from cpllm.model.loaders.gguf_source import GGUFSource

        return GGUFSource(path)
    raise ValueError(
        f"model path {path!r} is neither a folder with config.json and *.safetensors nor a .gguf file"
    )
