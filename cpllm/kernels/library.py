"""Every C library of this package: its functions' signatures, one cache, and the kill switch.

Each wrapper module asks `load(name)` on every call. It returns None when `CPLLM_KERNELS=0` is set now (read at
each call, so setting it at any time turns every kernel with a fallback off) or when the library could not be
built, and the wrapper's caller runs its torch fallback. A library is opened once per process (build.py compiles
it first where needed); its functions are typed from `SIGNATURES` and its structs checked against the compiled C
(structs.py) when it opens.

Data laid out once for a kernel (int4 weights packed for the VNNI or AVX2 kernel, the fused decode layers' specs) has no
fallback left to switch to: its users took their decision at load, when the switch was read, and call
`load_bound`, which ignores the switch from then on.
"""

from __future__ import annotations

import ctypes
import os

from cpllm.kernels.build import open_built
from cpllm.kernels.structs import DECODE_LAYER_STRUCTS, LayerSpec, StepSpec, check_layouts

_p, _i, _i64, _f = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
_layer_call = ([_p, ctypes.POINTER(LayerSpec), ctypes.POINTER(StepSpec), _p, _p, _p], _i)

SIGNATURES: dict[str, dict[str, tuple[list, object]]] = {
    "decode_attention": {"cpllm_paged_decode_attention": (
        [_p, _p, _p, _i, _i64, _p, _i64, _p, _i, _i, _i, _i, _f, _i, _i, _p, _p], _i)},
    "decode_rows": {"cpllm_rope_qk": ([_p, _i, _i64, _p, _i, _i64, _i64, _i, _p, _p], _i),
                    "cpllm_widen_rope_qkv": ([_p, _i, _i, _i, _i64, _i, _p, _p, _p, _i], _i),
                    "cpllm_store_rows": ([_p, _i64, _i64, _p, _p, _i64, _i64, _p, _i64, _i], _i),
                    "cpllm_silu_mul": ([_p, _i64, _i64, _p, _i], None),
                    "cpllm_silu_mul_bf16": ([_p, _i64, _i64, _p, _i, _i], None)},
    "rms_norm": {"cpllm_rms_norm": ([_p, _p, _f, _i64, _i64, _i64, _i64, _p, _i], None),
                 "cpllm_add_rms_norm": ([_p, _p, _i, _p, _f, _i64, _i64, _p, _p, _i, _i], None),
                 "cpllm_add_bf16_rows": ([_p, _p, _i64, _p, _i], None)},
    "int4_matmul": {"cpllm_int4_matmul": ([_p, _i64, _i, _p, _i, _p, _i], _i),
                    "cpllm_int4_available": ([], _i)},
    "int4_amx": {"cpllm_int4_amx_matmul": ([_p, _i64, _i, _p, _i, _i, _p, _i64, _i, _i], _i),
                 "cpllm_int4_amx_available": ([], _i)},
    "int4_dpbf16": {"cpllm_int4_dpbf16_matmul": ([_p, _i64, _i, _p, _i, _i, _p, _i64, _i, _i], _i),
                    "cpllm_int4_dpbf16_available": ([], _i)},
    "int4_avx2": {"cpllm_int4_avx2_matmul": ([_p, _i64, _i, _p, _i, _p, _i], _i),
                  "cpllm_int4_avx2_dequantize": ([_p, _i, _i, _i64, _i64, _p, _i, _i], _i),
                  "cpllm_int4_avx2_available": ([], _i)},
    "prefill_attention": {name: ([_p, _i64, _p, _p, _i64, _i, _i, _i, _i, _i, _f, _i, _p, _i, _p, _p, _i], _i)
                          for name in ("cpllm_prefill_attention", "cpllm_prefill_attention_bf16",
                                       "cpllm_prefill_attention_amx")},
    "index_scores": {"cpllm_index_scores": (
        [_p, _i64, _p, _i, _i, _i, _p, _i, _i64, _i64, _p, _p, _i64, _p, _f, _i, _p], _i)},
    "delta_chunk": {"cpllm_delta_chunk": ([_p, _p, _p, _p, _p, _p, _p, _p, _i64, _i64, _i64, _i64, _i], _i)},
    "kda_chunk": {"cpllm_kda_chunk": ([_p, _p, _p, _p, _p, _p, _p, _p, _i64, _i64, _i64, _i64, _i], _i)},
    "delta_step": {"cpllm_delta_step": ([_p, _p, _p, _p, _i, _p, _p, _p, _p, _i64, _i64, _i64, _i], _i)},
    "index_topk": {"cpllm_index_topk": ([_p, _i64, _p, _i, _i64, _i64, _i64, _i64, _i, _p, _p], _i)},
    "decode_layer": {"cpllm_decode_layer": _layer_call, "cpllm_decode_layer_tp": _layer_call,
                     "cpllm_f32_available": ([], _i), "cpllm_team_barrier": ([_p], _i),
                     "cpllm_f32_matmul_cols": ([_p, _i64, _i64, _p, _i64, _i64, _i64, _p, _i64, _i], _i),
                     "cpllm_struct_layout": ([ctypes.c_char_p, ctypes.c_char_p], _i64)},
}
"""Library (cpllm/kernels/<name>.c) -> each function it exports -> (argument types, result type)."""

STRUCTS: dict[str, dict[str, type[ctypes.Structure]]] = {"decode_layer": DECODE_LAYER_STRUCTS}
"""Library -> the C structs it takes -> their ctypes copies, checked when it opens."""

_loaded: dict[str, ctypes.CDLL | None] = {}
"""Library name -> the opened library, or None where it could not be built (the reason was logged once)."""

_environment = os.environ._data
"""The process environment as os.environ keeps it (bytes on POSIX), updated by every os.environ assignment:
os.environ.get encodes its key on each call (0.5 us, at every kernel call of a step); this lookup takes 40 ns."""


def enabled() -> bool:
    """False while CPLLM_KERNELS=0 asks for the torch fallbacks."""
    return _environment.get(b"CPLLM_KERNELS") != b"0"


def load(name: str) -> ctypes.CDLL | None:
    """The library `name`, or None: kernels switched off now, or not built on this machine."""
    if _environment.get(b"CPLLM_KERNELS") == b"0":
        return None
    try:
        return _loaded[name]
    except KeyError:
        return _open(name)


def load_bound(name: str) -> ctypes.CDLL | None:
    """The library `name` whatever the switch says now, for data a caller laid out for it at load (see the
    module); None where it is not built."""
    try:
        return _loaded[name]
    except KeyError:
        return _open(name)


def prepare(name: str, lib: ctypes.CDLL) -> ctypes.CDLL:
    """`lib`, built from <name>.c, with its functions typed and its structs checked (LayoutMismatch)."""
    for function, (argtypes, restype) in SIGNATURES[name].items():
        getattr(lib, function).argtypes = argtypes
        getattr(lib, function).restype = restype
    check_layouts(lib, STRUCTS.get(name, {}))
    return lib


def _open(name: str) -> ctypes.CDLL | None:
    lib = open_built(name)
    _loaded[name] = None if lib is None else prepare(name, lib)
    return _loaded[name]
