"""GQA on the Triton kernels (CUDA, or the CPU under Triton's interpreter): another backend of the GQA kind's
pools, chosen per device by `choice.kind_for`."""

BACKENDS = {"gqa-triton": "cpllm.layers.gqa_triton.backend:TritonPagedBackend"}
"""The backends this package adds to the GQA kind (cpllm/layers/registry.py)."""

PUBLIC_MODULES = ("choice",)
"""Modules other packages may import."""
