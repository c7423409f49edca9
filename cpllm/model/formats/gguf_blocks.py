"""GGUF blocks decoded into integer codes and one scale (and offset) per 32 values, without dequantizing.

Q8_0 (34 bytes per 32 values: d (f16), 32 int8 codes) is w = d * q. The 4-bit types:

All three store, for every run of 32 consecutive values of a row, 4-bit codes q in 0..15 and a map
w = d * q + m (GGUF's own "scale and min" form):
- Q4_0, 18 bytes per 32 values: d (f16), 16 bytes of codes; w = d * (q - 8), so m = -8 d;
- Q4_1, 20 bytes per 32 values: d (f16), m (f16), 16 bytes of codes;
- Q4_K, 144 bytes per 256 values: d, dmin (f16), 12 bytes of 6-bit sub-scales sc_j and sub-mins mn_j for its
  8 sub-blocks of 32, 128 bytes of codes; w = (d sc_j) q - (dmin mn_j).
In Q4_0 / Q4_1 the codes of a block are byte i's low nibble for value i and its high nibble for value 16 + i;
in Q4_K each 64 values share 32 bytes: low nibbles hold the first 32, high nibbles the next 32.
"""

from __future__ import annotations

import numpy as np

GROUP = 32
"""Values per affine map in every supported type."""

INT4_GGUF_TYPES = ("Q4_0", "Q4_1", "Q4_K")
"""GGUF tensor types whose blocks decode to 4-bit codes here (and run in the int4 kernel as stored)."""
INT8_GGUF_TYPES = ("Q8_0",)
"""GGUF tensor types whose blocks decode to 8-bit codes here."""

_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q4_K": 144, "Q8_0": 34}
_BLOCK_VALUES = {"Q4_0": 32, "Q4_1": 32, "Q4_K": 256, "Q8_0": 32}


def block_values(type_name: str) -> int:
    """Values per stored block of `type_name` (32, or 256 for Q4_K)."""
    return _BLOCK_VALUES[type_name]


def block_bytes(type_name: str) -> int:
    """Bytes per stored block of `type_name`."""
    return _BLOCK_BYTES[type_name]


def _blocks(raw: np.ndarray, type_name: str, decodable: tuple[str, ...]) -> np.ndarray:
    # uint8 [rows, blocks * block_bytes] -> [rows, blocks, block_bytes]
    if type_name not in decodable:
        raise ValueError(f"GGUF type {type_name} cannot be decoded here; decodable: {', '.join(decodable)}")
    rows, nbytes = raw.shape
    size = _BLOCK_BYTES[type_name]
    if nbytes % size != 0:
        raise ValueError(f"{nbytes} bytes per row is not a whole number of {type_name} blocks of {size} bytes")
    return np.ascontiguousarray(raw).reshape(rows, nbytes // size, size)


def decode_int8_blocks(raw: np.ndarray, type_name: str) -> tuple[np.ndarray, np.ndarray]:
    """Raw Q8_0 rows -> (codes int8 [rows, cols], d float32 [rows, cols/32]); w = d * q per group of 32."""
    blocks = _blocks(raw, type_name, INT8_GGUF_TYPES)
    rows = blocks.shape[0]
    return blocks[..., 2:34].view(np.int8).reshape(rows, -1), _f16(blocks, 0)


def decode_int4_blocks(raw: np.ndarray, type_name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Raw rows of blocks -> (codes uint8 [rows, cols], d float32 [rows, cols/32], m float32 [rows, cols/32]).

    raw: uint8 [rows, blocks * block_bytes], whole blocks of one row each; w = d * q + m per group of 32.
    """
    blocks = _blocks(raw, type_name, INT4_GGUF_TYPES)
    rows = blocks.shape[0]
    if type_name == "Q4_K":
        codes, d, m = _decode_q4_k(blocks)
    else:
        codes, d, m = _decode_q4_01(blocks, with_min=type_name == "Q4_1")
    groups = codes.shape[1] * codes.shape[2] // GROUP
    return codes.reshape(rows, -1), d.reshape(rows, groups), m.reshape(rows, groups)


def _f16(blocks: np.ndarray, offset: int) -> np.ndarray:
    # [rows, blocks] float32 from the little-endian f16 at `offset` of every block
    return np.ascontiguousarray(blocks[..., offset : offset + 2]).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    # [..., n] bytes -> [..., 2n] codes: the n low nibbles, then the n high nibbles
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _decode_q4_01(blocks: np.ndarray, *, with_min: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f16(blocks, 0)  # [rows, blocks]
    if with_min:
        m, qs = _f16(blocks, 2), blocks[..., 4:20]
    else:
        m, qs = -8.0 * d, blocks[..., 2:18]
    return _nibbles(qs), d, m  # codes [rows, blocks, 32]


def _k_scales_and_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # packed [rows, blocks, 12] -> 6-bit (sc, mn) [rows, blocks, 8]: sub-blocks 0-3 use the low 6 bits of bytes
    # 0-3 (sc) and 4-7 (mn); sub-blocks 4-7 take 4 low bits from bytes 8-11 and their top 2 bits from the top
    # 2 bits of bytes 0-3 (sc) and 4-7 (mn)
    p = packed.astype(np.uint16)
    sc_lo, mn_lo = p[..., 0:4] & 63, p[..., 4:8] & 63
    sc_hi = (p[..., 8:12] & 0x0F) | ((p[..., 0:4] >> 6) << 4)
    mn_hi = (p[..., 8:12] >> 4) | ((p[..., 4:8] >> 6) << 4)
    return np.concatenate([sc_lo, sc_hi], -1).astype(np.float32), np.concatenate([mn_lo, mn_hi], -1).astype(np.float32)


def _decode_q4_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d, dmin = _f16(blocks, 0)[..., None], _f16(blocks, 2)[..., None]  # [rows, blocks, 1]
    sc, mn = _k_scales_and_mins(blocks[..., 4:16])
    rows, count = blocks.shape[:2]
    qs = blocks[..., 16:144].reshape(rows, count, 4, 32)  # 4 runs of 64 values, 32 bytes each
    codes = _nibbles(qs).reshape(rows, count, 256)
    # d * sc and dmin * mn in float32, the order gguf's own dequantize multiplies them in
    return codes, d * sc, -(dmin * mn)
