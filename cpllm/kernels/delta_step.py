"""The delta rules' recurrent decode step in one C pass per head (cpllm/kernels/delta_step.c), for eager CPU steps.

`delta_step` returns None where the kernel does not apply (kernels off with CPLLM_KERNELS=0 or not built, another
device or dtype, a compiled graph) and the caller runs its torch form (cpllm/layers/*_delta/rule.py
`recurrent_step`, also the tests' reference). Shapes that disagree raise ValueError (the kernel would read past).
"""

from __future__ import annotations

import torch

from cpllm.kernels.library import load


def delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               state: torch.Tensor, overwrite: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
    """q, k [B, H, dk], v [B, H, dv], g [B, H] (one decay per head) or [B, H, dk] (per key channel), beta [B, H],
    state [B, H, dk, dv], float32 on the CPU -> (out [B, H, dv], the new states), or None. With `overwrite` the new
    states are written over a contiguous `state` (no 4 MiB allocation per layer and step: its pages are hot)."""
    tensors = (q, k, v, g, beta, state)
    if (torch.compiler.is_compiling() or any(x.dtype != torch.float32 or x.device.type != "cpu" for x in tensors)
            or state.dim() != 4):
        return None
    lib = load("delta_step")
    if lib is None:
        return None
    b, h, dk, dv = state.shape
    per_channel = g.dim() == 3
    if (q.shape != (b, h, dk) or k.shape != (b, h, dk) or v.shape != (b, h, dv) or beta.shape != (b, h)
            or g.shape != ((b, h, dk) if per_channel else (b, h))):
        raise ValueError(f"delta step kernel: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"g {tuple(g.shape)}, beta {tuple(beta.shape)} do not match the state {tuple(state.shape)}")
    q, k, v, g, beta = (x.contiguous() for x in tensors[:5])
    new_state = state if overwrite and state.is_contiguous() else torch.empty(b, h, dk, dv, dtype=torch.float32)
    state = state.contiguous()
    out = torch.empty(b, h, dv, dtype=torch.float32)
    if lib.cpllm_delta_step(q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), int(per_channel),
                            beta.data_ptr(), state.data_ptr(), new_state.data_ptr(), out.data_ptr(), b * h, dk, dv,
                            torch.get_num_threads()) != 0:
        return None
    return out, new_state
