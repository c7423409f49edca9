"""Weights from a Hugging Face folder: config.json plus one or many *.safetensors files."""

from __future__ import annotations

import glob
import json
import os
from typing import Any

import torch
from safetensors import safe_open

from cpllm.config.engine import ModelConfig
from cpllm.model.loaders.weight_slices import resolve_slice

_INDEX_FILE = "model.safetensors.index.json"


def normalize_hf_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Fold transformers >= 5's `rope_parameters` back into `rope_theta` / `rope_scaling`.

    transformers 5 writes the rotary base inside `rope_parameters` and no
    longer writes `rope_theta`; ModelConfig.from_hf_config reads the older
    keys, and would otherwise fall back to its default base silently.
    """
    params = cfg.get("rope_parameters")
    if not isinstance(params, dict):
        return cfg
    out = dict(cfg)
    if isinstance(params.get("full_attention"), dict):  # one dict per layer type (Gemma3)
        local = params.get("sliding_attention") or {}
        if local.get("rope_type", local.get("type", "default")) != "default":
            raise ValueError(f"rope_parameters of the sliding layers {local!r}: only unscaled rotary is supported "
                             "there (the full layers' scaling is)")
        if "rope_theta" in local:
            out.setdefault("rope_local_base_freq", local["rope_theta"])
        params = params["full_attention"]
    if "rope_theta" in params:
        out.setdefault("rope_theta", params["rope_theta"])
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default" and out.get("rope_scaling") is None:
        out["rope_scaling"] = {k: v for k, v in params.items() if k != "rope_theta"}
    return out


def read_hf_config(folder: str) -> ModelConfig:
    """ModelConfig from `folder/config.json`."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{folder!r} has no config.json; a Hugging Face model folder needs one")
    with open(path, encoding="utf-8") as f:
        return ModelConfig.from_hf_config(normalize_hf_config(json.load(f)))


def _tensor_files(folder: str) -> dict[str, str]:
    """Map every tensor name to the .safetensors file that holds it."""
    index_path = os.path.join(folder, _INDEX_FILE)
    if os.path.isfile(index_path):
        with open(index_path, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        return {name: os.path.join(folder, file) for name, file in weight_map.items()}
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{folder!r} holds no *.safetensors file")
    where: dict[str, str] = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                where[name] = file
    return where


class SafetensorsSource:
    """WeightSource over a Hugging Face folder; tensors are read lazily, slices without the rest."""

    def __init__(self, folder: str) -> None:
        self.path = folder
        self.config = read_hf_config(folder)
        self._where = _tensor_files(folder)
        self._handles: dict[str, Any] = {}  # file -> open safe_open handle, opened on first use

    def names(self) -> list[str]:
        return sorted(self._where)

    def has(self, name: str) -> bool:
        return name in self._where

    def _handle(self, name: str) -> Any:
        if name not in self._where:
            raise KeyError(f"tensor {name!r} is not in {self.path!r}")
        file = self._where[name]
        if file not in self._handles:
            self._handles[file] = safe_open(file, framework="pt")
        return self._handles[file]

    def storage_type(self, name: str) -> str:
        return self._handle(name).get_slice(name).get_dtype()

    def get_int4_groups(self, name: str, *, dim: int | None = None, start: int = 0, end: int | None = None):
        raise ValueError(f"{name} is stored as {self.storage_type(name)} in {self.path!r}; safetensors weights "
                         "hold no quantized blocks (quantize them at load with quantization='int4')")

    def get_int8_groups(self, name: str, *, dim: int | None = None, start: int = 0, end: int | None = None):
        raise ValueError(f"{name} is stored as {self.storage_type(name)} in {self.path!r}; safetensors weights "
                         "hold no quantized blocks (quantize them at load with quantization='int8')")

    def get(
        self,
        name: str,
        *,
        dim: int | None = None,
        start: int = 0,
        end: int | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        lazy = self._handle(name).get_slice(name)
        shape = tuple(lazy.get_shape())
        span = resolve_slice(name, shape, dim, start, end)
        if span is None:
            index: tuple[slice, ...] = tuple(slice(None) for _ in shape)
        else:
            d, lo, hi = span
            index = tuple(slice(lo, hi) if i == d else slice(None) for i in range(len(shape)))
        # get_slice reads only the requested bytes from the memory-mapped file
        return lazy[index].to(dtype)
