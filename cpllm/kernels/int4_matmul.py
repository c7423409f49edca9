"""4-bit grouped weights times activations quantized to int8 per group (cpllm/kernels/int4_matmul.c, AVX-512 VNNI).

`available()` says whether the kernel was built for this CPU; where it was not, the int4 layers run aten's int4
kernel instead (cpllm/model/formats/group_kernels.py). `pack` lays a weight out once at load; `int4_matmul` is the
matmul, a torch custom op so a compiled decode graph calls it without a graph break. An activation width or an
output count that the packed weight does not hold raises ValueError naming both.

A layer packs its weight for this kernel when it is built, if the kernels are on then; `CPLLM_KERNELS=0` set later
does not reach it (the packed layout has no other kernel), so `matmul` opens the library whatever the switch says
(`library.load_bound`).
"""

from __future__ import annotations

import torch

from cpllm.config.engine import QUANT_GROUP
from cpllm.kernels.library import load, load_bound

BLOCK_ROWS = 16
"""Output rows per block of the packed layout (one AVX-512 register of float32 results)."""


def available() -> bool:
    """The kernels are on, this one is built and this CPU has AVX-512 VNNI (builds it on the first call; asked once
    per layer, when it packs its weight)."""
    lib = load("int4_matmul")
    return lib is not None and lib.cpllm_int4_available() == 1


def pack(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """uint8 [ceil(rows / 16), cols / 32, 320]: the kernel's layout (see int4_matmul.c) of w = d q + m.

    codes uint8 [rows, cols] in 0..15; d, m [rows, cols / 32], kept as float16 (GGUF's Q4_0 / Q4_1 / Q8_0
    steps and offsets are float16 already; a Q4_K sub-block's d * scale rounds to float16's 11 bits).
    """
    rows, cols = codes.shape
    groups = cols // QUANT_GROUP
    pad = -rows % BLOCK_ROWS
    codes = torch.nn.functional.pad(codes, (0, 0, 0, pad))
    d16, m16 = (torch.nn.functional.pad(t.to(torch.float16), (0, 0, 0, pad)) for t in (d, m))
    if not (torch.isfinite(d16).all() and torch.isfinite(m16).all()):
        raise ValueError("int4 weight: a group's step or offset overflows float16")
    blocks = (rows + pad) // BLOCK_ROWS
    # [blocks, 16 rows, groups, 2 halves, 4 i, 4 b] -> [blocks, groups, i, rows, b], low | high << 4
    c = codes.view(blocks, BLOCK_ROWS, groups, 2, 4, 4).permute(0, 2, 3, 4, 1, 5)
    nibbles = (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(blocks, groups, 256)
    scales = torch.stack([d16, m16]).view(2, blocks, BLOCK_ROWS, groups).permute(1, 3, 0, 2)  # [b, g, 2, 16]
    return torch.cat([nibbles, scales.contiguous().view(torch.uint8).reshape(blocks, groups, 64)], dim=-1).contiguous()


def matmul(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """y [M, out_features] float32 = x [M, in] W^T, W packed by `pack`.

    Eager callers reach the C function directly: the custom op's dispatch costs about 15 us a call, a fifth of
    a step's matmul time at batch 1 over 121 calls; a compiled graph calls the op.
    """
    if torch.compiler.is_compiling():
        return int4_matmul_op(x, packed, out_features)
    return _run(x, packed, out_features)


def _run(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    x32 = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
    rows, width = x32.shape
    blocks, groups, _ = packed.shape
    if width != groups * QUANT_GROUP or not blocks * BLOCK_ROWS - BLOCK_ROWS < out_features <= blocks * BLOCK_ROWS:
        raise ValueError(f"int4 matmul: activations of width {width} and {out_features} outputs against a weight "
                         f"packed for {groups * QUANT_GROUP} inputs and {blocks * BLOCK_ROWS - BLOCK_ROWS + 1} to "
                         f"{blocks * BLOCK_ROWS} outputs")
    y = torch.empty(rows, out_features, dtype=torch.float32)
    if rows == 0:
        return y
    status = load_bound("int4_matmul").cpllm_int4_matmul(x32.data_ptr(), rows, width, packed.data_ptr(),
                                                         out_features, y.data_ptr(), torch.get_num_threads())
    if status != 0:
        raise MemoryError(f"int4 matmul kernel could not allocate its scratch for {rows} rows")
    return y


@torch.library.custom_op("cpllm::int4_matmul", mutates_args=())
def int4_matmul_op(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """`matmul` as one opaque op of a compiled graph."""
    return _run(x, packed, out_features)


@int4_matmul_op.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features, dtype=torch.float32)
