"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2, GLM-4.7-Flash): one latent row per position, the
absorbed form over it under every CP plan, the expanded form for a prefill's new tokens on one PCP rank."""

from cpllm.layers.kind import LayerKind
from cpllm.layers.mla.spec import latent_rows, serves

KIND = LayerKind(name="mla", serves=serves, cache_spec=latent_rows,
                 backends={"mla": "cpllm.layers.mla.backend:MLAPagedBackend"})

PUBLIC_MODULES = ("spec", "attention", "backend")
"""Modules other packages may import."""
