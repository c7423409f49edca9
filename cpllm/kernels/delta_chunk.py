"""The delta rules' chunked prefill per head over its blocks in C: the gated delta rule's (one decay per head,
cpllm/kernels/delta_chunk.c) and Kimi delta attention's (one per key channel, cpllm/kernels/kda_chunk.c).

`delta_chunk` returns None where the kernel does not apply (kernels off with CPLLM_KERNELS=0 or not built, another
device or dtype, a compiled graph) and the caller runs its torch form (cpllm/layers/gated_delta/rule.py
`chunked_delta_rule_torch`, cpllm/layers/kimi_delta/rule.py `chunked_kda_torch`; also the tests' references).
Shapes that disagree raise ValueError.
"""

from __future__ import annotations

import torch

from cpllm.kernels.library import load


def delta_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """q, k [T, H, dk], v [T, H, dv], g [T, H] (gated delta rule) or [T, H, dk] (KDA), beta [T, H], state
    [H, dk, dv], float32 on the CPU -> (out [T, H, dv], the state after the last token), or None."""
    tensors = (q, k, v, g, beta, state)
    if (torch.compiler.is_compiling() or any(x.dtype != torch.float32 or x.device.type != "cpu" for x in tensors)
            or state.dim() != 3 or q.shape[0] == 0):
        return None
    per_channel = g.dim() == 3
    lib = load("kda_chunk" if per_channel else "delta_chunk")
    if lib is None:
        return None
    h, dk, dv = state.shape
    t = q.shape[0]
    if (q.shape != (t, h, dk) or k.shape != (t, h, dk) or v.shape != (t, h, dv)
            or g.shape != ((t, h, dk) if per_channel else (t, h)) or beta.shape != (t, h)):
        raise ValueError(f"delta chunk kernel: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"g {tuple(g.shape)}, beta {tuple(beta.shape)} do not match the state {tuple(state.shape)}")
    q, k, v, g, beta, state = (x.contiguous() for x in tensors)
    out = torch.empty(t, h, dv, dtype=torch.float32)
    new_state = torch.empty_like(state)
    run = lib.cpllm_kda_chunk if per_channel else lib.cpllm_delta_chunk
    if run(q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(),
           state.data_ptr(), new_state.data_ptr(), out.data_ptr(), t, h, dk, dv, torch.get_num_threads()) != 0:
        return None
    return out, new_state
