"""The int4 layers' prefill GEMM on AMX tiles, the weight dequantized straight into the tiles (cpllm/kernels/int4_amx.c).

For a few hundred rows, dequantizing a whole weight and handing it to oneDNN's bf16 GEMM costs more than the
products: oneDNN reorders the weight on every call, and the dequantized copy goes out to memory and back. This
kernel turns each stored group of 16 output rows x 32 inputs into one AMX B tile in L2 and multiplies there (on one
Sapphire Rapids core, SmolLM2's four projections in 0.45-0.62x the time at 64-256 rows, 0.72x at 512, 0.93x at
1,024, 1.02-1.13x at 2,048). Its bf16 weights are the other bf16 ways' (w = d q + m rounded once), its
accumulation float32, a row's result independent of the other rows. int4_choice.py measures below which row count
it runs. `matmul` returns None where it does not run here (no AMX, the OS refused the tile state, kernels off).
"""

from __future__ import annotations

import torch

from cpllm.kernels.int4_avx2 import check_shapes
from cpllm.kernels.library import load, load_bound


def available() -> bool:
    """The kernels are on, this one is built with AMX tiles and AVX-512 BF16, and the OS grants the tile state."""
    lib = load("int4_amx")
    return lib is not None and lib.cpllm_int4_amx_available() == 1


def matmul(x: torch.Tensor, packed: torch.Tensor, out_features: int, native: bool = False) -> torch.Tensor | None:
    """y [M, out_features] = x [M, in] W^T (W packed by `int4_matmul.pack`), x rounded to bf16 first: bf16 with
    `native`, else those values in float32 (a bf16 GEMM's output widened); None where the kernel does not run."""
    xb = x if x.dtype == torch.bfloat16 and x.stride(1) == 1 else x.to(torch.bfloat16).contiguous()
    check_shapes(xb.shape[1], packed, out_features)
    if xb.shape[0] == 0:
        return torch.empty(0, out_features, dtype=torch.bfloat16 if native else torch.float32)
    lib = load_bound("int4_amx")
    if lib is None:
        return None
    y = torch.empty(xb.shape[0], out_features, dtype=torch.bfloat16 if native else torch.float32)
    status = lib.cpllm_int4_amx_matmul(xb.data_ptr(), xb.stride(0), xb.shape[0], packed.data_ptr(), xb.shape[1],
                                       out_features, y.data_ptr(), y.stride(0), 1 if native else 2,
                                       torch.get_num_threads())
    if status == 2:
        return None
    if status != 0:
        raise MemoryError(f"int4 AMX matmul failed (status {status}) on x {tuple(xb.shape)} and "
                          f"{out_features} outputs")
    return y
