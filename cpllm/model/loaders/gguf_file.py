"""A GGUF file's metadata and tensor table, read in one pass over a memory map; tensor data is never touched here.

The `gguf` package's GGUFReader builds a numpy view for every part of every
metadata value, the 49k-entry vocabulary and merge table included: seconds per
parse, at every start, in every rank process. This reader walks the same bytes
with `struct`, keeps string arrays only where asked (the tokenizer's), and
hands out each tensor as one numpy view of the mapped file in the shape
GGUFReader gives it (elements for F32 / F16, bytes along the last axis for
every block-quantized type and BF16), so the dequantizers read it unchanged.
Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (version 2 and 3).
"""

from __future__ import annotations

import mmap
import struct
from typing import Any, Callable, Collection, NamedTuple

import numpy as np
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES

_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
"""Fixed-width metadata value types (GGUF type id -> struct format); 8 is a string, 9 an array."""
_STRING, _ARRAY = 8, 9
_ELEMENT_DTYPES = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}
"""Tensor types stored as plain elements; every other type is handed out as bytes (blocks)."""
TOKENIZER_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")
"""The string arrays only a tokenizer build reads (the rest of the metadata is small)."""


class StoredTensor(NamedTuple):
    """One tensor as the file stores it."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    """Hugging Face (row-major) order: (out, in) for a projection; GGUF writes it reversed."""
    data: np.ndarray
    """Read-only view of the mapped file: shape `shape` for F32 / F16, else (*shape[:-1], bytes per row)."""


class GGUFFile:
    """`metadata` (key -> value; string arrays not asked for are their length) and `tensors`, in file order."""

    def __init__(self, path: str, string_arrays: Collection[str] = ()) -> None:
        self.path = path
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._pos = 0
        if self._map[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (its first bytes are not 'GGUF')")
        version, tensor_count, kv_count = struct.unpack_from("<IQQ", self._map, 4)
        if version not in (2, 3):
            raise ValueError(f"{path} is GGUF version {version}; cpllm reads versions 2 and 3")
        self._pos = 24
        self.metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = self._string()
            (kind,) = self._unpack("<I")
            self.metadata[key] = self._value(kind, keep_strings=key in string_arrays)
        table = [self._tensor_entry() for _ in range(tensor_count)]
        alignment = int(self.metadata.get("general.alignment", 32))
        data_start = -(-self._pos // alignment) * alignment
        whole = np.frombuffer(self._map, dtype=np.uint8)
        self.tensors = [self._tensor(whole, data_start, *entry) for entry in table]

    def _unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (length,) = self._unpack("<Q")
        start, self._pos = self._pos, self._pos + length
        return self._map[start : self._pos].decode("utf-8")

    def _value(self, kind: int, keep_strings: bool = False) -> Any:
        if kind in _SCALAR:
            return self._unpack(_SCALAR[kind])[0]
        if kind == _STRING:
            return self._string()
        if kind != _ARRAY:
            raise ValueError(f"{self.path}: metadata value of unknown type {kind}")
        element, count = self._unpack("<IQ")
        if element in _SCALAR:
            return list(self._unpack(f"<{count}{_SCALAR[element][1:]}"))
        if element == _STRING and not keep_strings:  # a vocabulary nobody asked for: skip it, keep its length
            for _ in range(count):
                (length,) = self._unpack("<Q")
                self._pos += length
            return count
        return [self._value(element, keep_strings) for _ in range(count)]

    def _tensor_entry(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        (dims,) = self._unpack("<I")
        shape = tuple(reversed(self._unpack(f"<{dims}Q")))
        kind, offset = self._unpack("<IQ")
        return name, shape, kind, offset

    def _tensor(self, whole: np.ndarray, data_start: int, name: str, shape: tuple[int, ...], kind: int,
                offset: int) -> StoredTensor:
        try:
            tensor_type = GGMLQuantizationType(kind)
        except ValueError:
            raise ValueError(f"GGUF tensor {name!r} has unknown ggml type {kind}") from None
        start = data_start + offset
        if tensor_type in _ELEMENT_DTYPES:
            dtype = np.dtype(_ELEMENT_DTYPES[tensor_type])
            count = int(np.prod(shape))
            data = whole[start : start + count * dtype.itemsize].view(dtype).reshape(shape)
        else:
            block, block_bytes = GGML_QUANT_SIZES[tensor_type]
            stored = (*shape[:-1], shape[-1] // block * block_bytes)
            data = whole[start : start + int(np.prod(stored))].reshape(stored)
        return StoredTensor(name=name, tensor_type=tensor_type, shape=shape, data=data)


def arch_meta(meta: Callable[[str, Any], Any], arch: str, family: str) -> Callable[..., Any]:
    """`m(name, default=None, required=False)`: the file's `{arch}.{name}` metadata key, a missing required one
    refused naming the key and `family` (what needs it)."""
    def m(name: str, default: Any = None, required: bool = False) -> Any:
        value = meta(f"{arch}.{name}", default)
        if required and value is None:
            raise ValueError(f"{arch} GGUF file has no {arch}.{name}; {family} needs it")
        return value
    return m
