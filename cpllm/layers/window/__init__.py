"""Windows, soft-capping and sinks: the score modifiers a layer of any row kind composes (a sliding window's
cache is the GQA kind's SLIDING spec, cpllm/layers/gqa/spec.py)."""

PUBLIC_MODULES = ("modifier",)
"""Modules other packages may import."""
