"""Which backend a GQA model's layers take on a device: the Triton kernels on CUDA where triton imports."""

from __future__ import annotations

import os

import torch

from cpllm.kernels import triton_attention

ENV_SWITCH = "CPLLM_TRITON"
"""Set to 0 to keep CUDA ranks on the GQA backend's SDPA path (read when a model is built)."""


def kind_for(kind: str, device: torch.device | str | None = None) -> str:
    """The backend kind a model of attention kind `kind` uses on `device` (None: the default device, which a
    runner sets while it builds the model): "gqa-triton" for "gqa" on CUDA where triton imports (and
    CPLLM_TRITON is not 0), else `kind` itself."""
    device = torch.get_default_device() if device is None else torch.device(device)
    if kind == "gqa" and device.type == "cuda" and os.environ.get(ENV_SWITCH, "1") != "0" \
            and triton_attention.available():
        return "gqa-triton"
    return kind
