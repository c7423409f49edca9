"""GQA on the Triton kernels (CUDA, or the CPU under Triton's interpreter): another backend of the GQA kind's
pools, chosen per device by `choice.kind_for`."""

BACKENDS = {"gqa-triton": "cpllm.layers.gqa_triton.backend:TritonPagedBackend"}
"""The backends this package adds to the GQA kind (cpllm/layers/registry.py)."""

GRAPH_CAPTURABLE = ("gqa-triton",)
"""Its backends whose decode calls a CUDA graph can capture (no host-side mask or view)."""

PUBLIC_MODULES = ("choice",)
"""Modules other packages may import."""
