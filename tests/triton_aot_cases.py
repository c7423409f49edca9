"""Subprocess side of tests/test_triton_attention.py's compile check: the Triton kernels compiled ahead of time for
NVIDIA targets (sm_80, sm_90) on a machine without a GPU (triton's CUDA backend lowers to PTX and runs its bundled
ptxas without a device). Catches what the interpreter does not: typing of loop bounds and mixed integer widths,
tl.dot shape rules, shared memory over a target's limit.

    python tests/triton_aot_cases.py      # prints one JSON object {case: "ok, N bytes shared" or the error}
"""

from __future__ import annotations

import json
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cpllm.kernels import triton_decode_kernels as decode  # noqa: E402
from cpllm.kernels import triton_prefill_kernels as prefill  # noqa: E402
from cpllm.kernels.triton_attention import BLOCK_N, next_pow2  # noqa: E402
from cpllm.kernels.triton_prefill import _blocks  # noqa: E402

SHARED_LIMIT = {80: 166912, 90: 232448}
"""Bytes of shared memory one block may use (A100, H100/H200)."""

DECODE_ARGS = ["q_ptr", "k_ptr", "v_ptr", "slots_ptr", "lengths_ptr", "out_ptr", "lse_ptr", "scale", "split_len",
               "stride_qb", "stride_qh", "stride_kn", "stride_kh", "stride_vn", "stride_vh", "stride_sb", "stride_ob",
               "stride_oh", "stride_os", "stride_lb", "stride_lh"]
MERGE_ARGS = ["part_ptr", "part_lse_ptr", "out_ptr", "lse_ptr", "splits", "stride_pb", "stride_ph", "stride_ps",
              "stride_plb", "stride_plh", "stride_ob", "stride_oh", "stride_lb", "stride_lh"]
PREFILL_ARGS = ["q_ptr", "ck_ptr", "cv_ptr", "slots_ptr", "nk_ptr", "nv_ptr", "out_ptr", "lse_ptr", "scale", "num_q",
                "ctx_len", "num_new", "stride_ql", "stride_qh", "stride_ckn", "stride_ckh", "stride_cvn",
                "stride_cvh", "stride_nkn", "stride_nkh", "stride_nvn", "stride_nvh", "stride_ol", "stride_oh",
                "stride_ll"]


def _compile(fn, signature: dict, constexprs: dict, arch: int) -> str:
    for name in constexprs:
        signature[name] = "constexpr"
    kernel = triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", arch, 32))
    shared = kernel.metadata.shared
    if shared > SHARED_LIMIT[arch]:
        raise ValueError(f"{shared} bytes of shared memory, over sm_{arch}'s {SHARED_LIMIT[arch]}")
    return f"ok, {shared} bytes shared"


def decode_case(dtype: str, group: int, head_dim: int, index: str, arch: int) -> str:
    types = [f"*{dtype}"] * 3 + [f"*{index}", f"*{index}", "*fp32", "*fp32", "fp32"] + ["i32"] * 13
    return _compile(decode.decode_split_kernel, dict(zip(DECODE_ARGS, types)),
                    dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_G=next_pow2(group), BLOCK_D=next_pow2(head_dim),
                         BLOCK_N=BLOCK_N, WIDEN=dtype == "fp32"), arch)


def merge_case(arch: int) -> str:
    return _compile(decode.merge_splits_kernel, dict(zip(MERGE_ARGS, ["*fp32"] * 4 + ["i32"] * 10)),
                    dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_S=64), arch)


def prefill_case(dtype: str, head_dim: int, slots: bool, arch: int) -> str:
    block_m, block_n = _blocks(head_dim, dtype == "fp32")
    types = [f"*{dtype}"] * 3 + ["*i64"] + [f"*{dtype}"] * 2 + ["*fp32"] * 2 + ["fp32"] + ["i32"] * 16
    return _compile(prefill.prefill_kernel, dict(zip(PREFILL_ARGS, types)),
                    dict(GROUP=4, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=next_pow2(head_dim),
                         USE_SLOTS=slots, WIDEN=dtype == "fp32"), arch)


CASES = {
    "decode_bf16_g4_d64_sm90": lambda: decode_case("bf16", 4, 64, "i64", 90),
    "decode_fp16_g8_d128_sm80": lambda: decode_case("fp16", 8, 128, "i64", 80),
    "decode_fp32_g1_d256_sm90": lambda: decode_case("fp32", 1, 256, "i64", 90),
    "decode_bf16_g3_d96_int32_slots_sm90": lambda: decode_case("bf16", 3, 96, "i32", 90),  # the graphs' buffers
    "merge_sm90": lambda: merge_case(90),
    "prefill_bf16_d128_slots_sm90": lambda: prefill_case("bf16", 128, True, 90),
    "prefill_bf16_d256_keys_sm80": lambda: prefill_case("bf16", 256, False, 80),
    "prefill_fp32_d256_slots_sm80": lambda: prefill_case("fp32", 256, True, 80),
}


def main() -> None:
    results = {}
    for name, case in CASES.items():
        try:
            results[name] = case()
        except Exception as exc:  # noqa: BLE001 - reported to the pytest process, which fails the case
            results[name] = f"FAILED {type(exc).__name__}: {str(exc)[:2000]}"
    print(json.dumps(results))


if __name__ == "__main__":
    main()
