"""The ctypes copies of the C structs the fused decode layers take (decode_layer.c, decode_team.h), and their check.

A ctypes struct repeats its C struct by hand; a field added, removed or reordered on one side only would have the
C code read the wrong bytes. decode_layer.c exports `cpllm_struct_layout` (each struct's sizeof and each field's
offsetof, from the compiler), and `check_layouts` compares every copy here with it when the library loads.
"""

from __future__ import annotations

import ctypes

TeamCheck = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_double)
"""decode_team.h's team_check_fn: called every 50 ms of a barrier's wait; nonzero gives the wait up."""


LINEAR_INT4, LINEAR_F32 = 0, 1
"""linear_spec kinds: int4 groups packed for the VNNI kernel (int4_matmul.pack), float32 [in, out]."""


class LinearSpec(ctypes.Structure):
    """decode_layer.c's linear_spec: a weight's address and kind (LINEAR_INT4 packed, LINEAR_F32 [in, out])."""

    _fields_ = [("weight", ctypes.c_void_p), ("kind", ctypes.c_int)]


class LayerSpec(ctypes.Structure):
    """decode_layer.c's layer_spec: one decoder layer's weights and shapes."""

    _fields_ = [("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("qkv", LinearSpec),
                ("o", LinearSpec), ("gate_up", LinearSpec), ("down", LinearSpec), ("hidden", ctypes.c_int),
                ("heads", ctypes.c_int), ("kv_heads", ctypes.c_int), ("head_dim", ctypes.c_int),
                ("intermediate", ctypes.c_int), ("eps", ctypes.c_float), ("scale", ctypes.c_float)]


class StepSpec(ctypes.Structure):
    """decode_layer.c's step_spec: one decode step's rotary tables, K/V writes and context slots (build it with
    `cpllm.kernels.decode_layer.step_spec`, which checks the tensors it points into)."""

    _fields_ = [("batch", ctypes.c_int64), ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p),
                ("write_rows", ctypes.c_void_p), ("write_slots", ctypes.c_void_p), ("writes", ctypes.c_int64),
                ("slots", ctypes.c_void_p), ("lengths", ctypes.c_void_p), ("slot_stride", ctypes.c_int64),
                ("pool_dtype", ctypes.c_int), ("chunk", ctypes.c_int), ("threads", ctypes.c_int),
                ("num_slots", ctypes.c_int64)]


class TeamSpec(ctypes.Structure):
    """decode_team.h's team_spec: a decode team's shared buffers and barrier state."""

    _fields_ = [("flags", ctypes.c_void_p), ("qkv", ctypes.c_void_p), ("partials", ctypes.c_void_p),
                ("lses", ctypes.c_void_p), ("hidden_part", ctypes.c_void_p), ("gate_up", ctypes.c_void_p),
                ("max_batch", ctypes.c_int64), ("member", ctypes.c_int), ("size", ctypes.c_int),
                ("seq", ctypes.c_int64), ("check", TeamCheck), ("sums", ctypes.c_void_p), ("q_group", ctypes.c_void_p),
                ("dcp", ctypes.c_int)]


DECODE_LAYER_STRUCTS = {"linear_spec": LinearSpec, "layer_spec": LayerSpec, "step_spec": StepSpec,
                        "team_spec": TeamSpec}
"""C name -> ctypes copy, for every struct the decode_layer library takes."""


class LayoutMismatch(TypeError):
    """A ctypes struct does not lay its fields out as the compiled C struct does."""


def check_layouts(lib: ctypes.CDLL, structs: dict[str, type[ctypes.Structure]]) -> None:
    """Raise LayoutMismatch unless each struct's size and every field's offset equal what `lib` reports
    (`cpllm_struct_layout`, typed by the caller)."""
    for c_name, copy in structs.items():
        problems = []
        size = lib.cpllm_struct_layout(c_name.encode(), None)
        if size != ctypes.sizeof(copy):
            problems.append(f"{ctypes.sizeof(copy)} bytes, C's {size}")
        for field, _ in copy._fields_:
            offset = lib.cpllm_struct_layout(c_name.encode(), field.encode())
            if offset != getattr(copy, field).offset:
                where = "not in C's struct" if offset < 0 else f"at C's offset {offset}"
                problems.append(f"{field} at offset {getattr(copy, field).offset}, {where}")
        if problems:
            raise LayoutMismatch(f"ctypes struct {copy.__name__} does not match C's {c_name}: {'; '.join(problems)}")
