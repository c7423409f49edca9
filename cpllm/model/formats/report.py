"""What each class of weight runs as, and the weight bytes of this rank: the start-up log of quantization."""

from __future__ import annotations

import re
from collections import Counter, defaultdict

import torch

from cpllm.model.rope import RotaryEmbedding

_LAYER = re.compile(r"^model\.layers\.\d+\.")


def tensor_class(name: str) -> str:
    """'model.layers.7.self_attn.q_proj.weight' -> 'self_attn.q_proj'; 'lm_head.weight' -> 'lm_head'."""
    return _LAYER.sub("", name).removesuffix(".weight")


def format_counts(model: torch.nn.Module) -> dict[str, Counter]:
    """tensor class -> Counter of "format (reason)" over the layers, from each layer's recorded plans."""
    counts: dict[str, Counter] = defaultdict(Counter)
    for module in model.modules():
        for name, plan in getattr(module, "plans", ()):
            counts[tensor_class(name)][f"{plan.format} ({plan.reason})"] += 1
    return dict(counts)


def weight_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of this rank's weights by format ("float", "int8", "int4"), each tensor counted once; rotary tables
    are not weights. A module holding quantized tensors says which in its `weight_format` (the formats' methods and
    their kernels, cpllm/model/formats/); the rest are float."""
    totals: Counter = Counter()
    seen: set[int] = set()
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            continue
        kind = getattr(module, "weight_format", "float")
        for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            if tensor is not None and id(tensor) not in seen:
                seen.add(id(tensor))
                totals[kind] += tensor.numel() * tensor.element_size()
    return dict(totals)


def summary_lines(model: torch.nn.Module, quantization: str) -> list[str]:
    """Human-readable lines: one per tensor class, then the bytes."""
    lines = [f"weights (quantization={quantization}):"]
    for cls, counts in format_counts(model).items():
        lines.append(f"  {cls}: " + ", ".join(f"{what} x{n}" for what, n in counts.items()))
    by_format = weight_bytes(model)
    parts = ", ".join(f"{k} {v / 2**20:.2f}" for k, v in sorted(by_format.items()))
    lines.append(f"  weight bytes on this rank: {sum(by_format.values()) / 2**20:.2f} MiB ({parts})")
    return lines
