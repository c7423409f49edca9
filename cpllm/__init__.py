"""cpllm: an LLM inference engine for long prompts, built around context parallelism."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]

_EXPORTS = {
    "LLM": "cpllm.engine.llm",
    "SamplingParams": "cpllm.engine.sampling_params",
    "RequestOutput": "cpllm.engine.outputs",
    "CompletionOutput": "cpllm.engine.outputs",
    "Logprob": "cpllm.engine.outputs",
}


def __getattr__(name: str) -> Any:
    # Lazy, so that torch-free parts (the scheduler) import without pulling in torch.
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'cpllm' has no attribute {name!r}")
