"""The int4 layers' prefill GEMM with the weight dequantized straight from its stored records into the operands:
AMX tiles where the CPU has them (cpllm/kernels/int4_amx.c), else AVX-512 BF16 dot products
(cpllm/kernels/int4_dpbf16.c).

For a few hundred rows, dequantizing a whole weight and handing it to oneDNN's bf16 GEMM costs more than the
products: oneDNN reorders the weight on every call, and the dequantized copy goes out to memory and back. These
kernels turn each stored group of 16 output rows x 32 inputs into one operand in L2 (an AMX B tile, or the 16
registers vdpbf16ps multiplies) and multiply there. On one Sapphire Rapids core the tiles ran SmolLM2's four
projections in 0.45-0.62x the time at 64-256 rows, 0.72x at 512, 0.93x at 1,024, 1.02-1.13x at 2,048
(docs/benchmarks.md has the dot products' figures on AMD Zen 4). Their bf16 weights are the other bf16 ways' (w = d q
+ m rounded once), their accumulation float32, a row's result independent of the other rows. int4_choice.py
measures below which row count they run. `matmul` returns None where neither runs here (no AVX-512 BF16, the OS
refused AMX's tile state, kernels off).
"""

from __future__ import annotations

import functools

import torch

from cpllm.kernels.int4_avx2 import check_shapes
from cpllm.kernels.library import enabled, load_bound

KERNELS = ("int4_amx", "int4_dpbf16")
"""The record-fed kernels, by library name, in the order tried: tiles first."""


@functools.cache
def _runs(name: str) -> bool:
    """The kernel `name` is built for this CPU's instructions and (AMX) the OS grants the tile state: asked once per
    process, since neither changes (every prefill GEMM asks which kernel runs)."""
    lib = load_bound(name)
    return lib is not None and getattr(lib, f"cpllm_{name}_available")() == 1


def kernel_here(kernels: tuple[str, ...] = KERNELS) -> str | None:
    """The first of `kernels` that runs here, while the kernels are on; None where none does."""
    return next((name for name in kernels if _runs(name)), None) if enabled() else None


def available() -> bool:
    """One of the record-fed kernels runs here."""
    return kernel_here() is not None


def matmul(x: torch.Tensor, packed: torch.Tensor, out_features: int, native: bool = False,
           kernel: str | None = None) -> torch.Tensor | None:
    """y [M, out_features] = x [M, in] W^T (W packed by `int4_matmul.pack`), x rounded to bf16 first: bf16 with
    `native`, else those values in float32 (a bf16 GEMM's output widened). On `kernel` (one of KERNELS), else the
    first that runs here; None where it does not run."""
    xb = x if x.dtype == torch.bfloat16 and x.stride(1) == 1 else x.to(torch.bfloat16).contiguous()
    check_shapes(xb.shape[1], packed, out_features)
    if xb.shape[0] == 0:
        return torch.empty(0, out_features, dtype=torch.bfloat16 if native else torch.float32)
    name = kernel_here() if kernel is None else kernel
    lib = None if name is None else load_bound(name)
    if lib is None:
        return None
    y = torch.empty(xb.shape[0], out_features, dtype=torch.bfloat16 if native else torch.float32)
    status = getattr(lib, f"cpllm_{name}_matmul")(xb.data_ptr(), xb.stride(0), xb.shape[0], packed.data_ptr(),
                                                  xb.shape[1], out_features, y.data_ptr(), y.stride(0),
                                                  1 if native else 2, torch.get_num_threads())
    if status == 2:
        return None
    if status != 0:
        raise MemoryError(f"int4 {name} matmul failed (status {status}) on x {tuple(xb.shape)} and "
                          f"{out_features} outputs")
    return y
