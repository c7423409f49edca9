"""Subprocess side of tests/test_triton_attention.py: the Triton kernels run by Triton's interpreter on the CPU.

TRITON_INTERPRET must be set before triton is imported, and only here (another test's process may import triton
through torch and must not get the interpreter), so tests/test_triton_attention.py runs this file as a script:

    TRITON_INTERPRET=1 python tests/triton_interpret_cases.py GROUP

It prints one JSON object: {case name: [error, tolerance]} (or {case name: "error text"} for a case that raised).
Every error is the largest |kernel - float64 reference| over the outputs and the finite log-sum-exps, on inputs
rounded to the case's dtype once (the reference sees exactly those values); rows with no key must come back as
(0, -inf) exactly, or the case's error is infinite.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (by the kernels, on first use)

import torch  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from cpllm.context_parallel.sdpa import reference_attention  # noqa: E402
from cpllm.kernels.triton_attention import paged_decode_attention  # noqa: E402
from cpllm.kernels.triton_prefill import prefill_attention  # noqa: E402

TOL = 2e-5
"""Under the interpreter the products run in float32 (triton_attention.widen) on dtype-rounded inputs: the error
is float32 accumulation's (measured ~5e-7); a wrong mask, slot or merge is off by O(0.1)."""
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def _error(out, lse, ref_out, ref_lse) -> float:
    # out/ref_out [..., D], lse/ref_lse [...]: -inf exactly where the reference has no key, 0 output there
    empty = torch.isneginf(ref_lse)
    if not torch.equal(torch.isneginf(lse), empty) or bool(out[empty].abs().max() > 0 if empty.any() else False):
        return float("inf")
    err = (out.double() - ref_out).abs().max().item()
    if (~empty).any():
        err = max(err, (lse.double() - ref_lse)[~empty].abs().max().item())
    return err


def _decode_reference(q, k_pool, v_pool, slots, lengths, scale):
    outs, lses = [], []
    for b in range(q.shape[0]):
        rows = slots[b, : int(lengths[b])]
        k, v = k_pool[rows].double(), v_pool[rows].double()  # [L, Hkv, D]
        o, lse = reference_attention(q[b : b + 1, :, None].double(), k.transpose(0, 1)[None],
                                     v.transpose(0, 1)[None], scale=scale)  # [1, Hq, 1, D], [1, Hq, 1]
        outs.append(o[0, :, 0])
        lses.append(lse[0, :, 0])
    return torch.stack(outs), torch.stack(lses)


def decode_case(seed: int, *, hq: int, hkv: int, d: int, lengths: list[int], dtype: torch.dtype,
                q_dtype: torch.dtype | None = None, splits: int | None = None, extra_width: int = 3) -> float:
    g = torch.Generator().manual_seed(seed)
    num_slots = sum(lengths) + 40
    k_pool = torch.randn(num_slots, hkv, d, generator=g).to(dtype)
    v_pool = torch.randn(num_slots, hkv, d, generator=g).to(dtype)
    q = torch.randn(len(lengths), hq, d, generator=g).to(q_dtype or dtype)
    width = max(lengths) + extra_width  # padded past the longest, as a static graph buffer is
    slots = torch.zeros(len(lengths), width, dtype=torch.long)
    for b, n in enumerate(lengths):  # each request's own scattered slots, never read past its length
        slots[b, :n] = torch.randperm(num_slots, generator=g)[:n]
        slots[b, n:] = 10**9  # out of the pool: a read past the length would fail or poison the result
    lengths_t = torch.tensor(lengths, dtype=torch.long)
    scale = d**-0.5
    out, lse = paged_decode_attention(q, k_pool, v_pool, slots, lengths_t, scale, splits=splits)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32 and out.shape == q.shape
    ref_out, ref_lse = _decode_reference(q, k_pool, v_pool, slots, lengths_t, scale)
    return _error(out, lse, ref_out, ref_lse)


def prefill_case(seed: int, *, hq: int, hkv: int, d: int, num_q: int, ctx: int, dtype: torch.dtype,
                 paged: bool = True, causal: bool = True) -> float:
    g = torch.Generator().manual_seed(seed)
    num_slots = ctx + 50
    k_pool = torch.randn(num_slots, hkv, d, generator=g).to(dtype)
    v_pool = torch.randn(num_slots, hkv, d, generator=g).to(dtype)
    q = torch.randn(num_q, hq, d, generator=g).to(dtype)
    new_k = torch.randn(num_q, hkv, d, generator=g).to(dtype)
    new_v = torch.randn(num_q, hkv, d, generator=g).to(dtype)
    slots = torch.randperm(num_slots, generator=g)[:ctx]
    scale = d**-0.5
    ctx_k, ctx_v = k_pool[slots], v_pool[slots]
    kwargs = dict(new_k=new_k, new_v=new_v) if causal else {}
    if paged:
        out, lse = prefill_attention(q, k_pool, v_pool, scale, slots=slots, **kwargs)
    else:
        out, lse = prefill_attention(q, ctx_k, ctx_v, scale, **kwargs)
    keys = torch.cat((ctx_k, new_k)) if causal else ctx_k
    values = torch.cat((ctx_v, new_v)) if causal else ctx_v
    keep = torch.ones(num_q, keys.shape[0], dtype=torch.bool)
    if causal:
        keep[:, ctx:] = torch.ones(num_q, num_q, dtype=torch.bool).tril()
    ref_out, ref_lse = reference_attention(q.double().transpose(0, 1)[None], keys.double().transpose(0, 1)[None],
                                           values.double().transpose(0, 1)[None], scale=scale, mask=keep)
    return _error(out, lse, ref_out[0].transpose(0, 1), ref_lse[0].transpose(0, 1))


def group_decode() -> dict:
    cases = {}
    for name, dtype in DTYPES.items():  # GQA 4:1, a length of 0, 1, lengths off the 32-key block
        cases[f"decode_{name}_d64_g4"] = lambda dtype=dtype: decode_case(
            1, hq=8, hkv=2, d=64, lengths=[300, 0, 1, 45], dtype=dtype)
    cases["decode_f32_d128_mha_split7"] = lambda: decode_case(2, hq=2, hkv=2, d=128, lengths=[333, 97],
                                                              dtype=torch.float32, splits=7)
    cases["decode_bf16_d256_g8_split3"] = lambda: decode_case(3, hq=8, hkv=1, d=256, lengths=[130, 64],
                                                              dtype=torch.bfloat16, splits=3)
    cases["decode_f16_d96_g3"] = lambda: decode_case(4, hq=6, hkv=2, d=96, lengths=[77, 200],
                                                     dtype=torch.float16)  # no power of two: masked lanes
    cases["decode_f32_d8_g2"] = lambda: decode_case(5, hq=4, hkv=2, d=8, lengths=[10, 3, 0],
                                                    dtype=torch.float32)  # the tiny test models' head size
    cases["decode_f32q_bf16pool"] = lambda: decode_case(6, hq=4, hkv=2, d=64, lengths=[90, 33],
                                                        dtype=torch.bfloat16, q_dtype=torch.float32)
    cases["decode_all_empty"] = lambda: decode_case(7, hq=4, hkv=2, d=64, lengths=[0, 0], dtype=torch.float32,
                                                    splits=2)
    return cases


def group_prefill() -> dict:
    cases = {}
    for name, dtype in DTYPES.items():  # a chunk over blocks of 64 queries, its context read through slots
        cases[f"prefill_{name}_d64_g2"] = lambda dtype=dtype: prefill_case(
            11, hq=4, hkv=2, d=64, num_q=70, ctx=50, dtype=dtype)
    cases["prefill_f32_d128_noctx"] = lambda: prefill_case(12, hq=2, hkv=1, d=128, num_q=33, ctx=0,
                                                           dtype=torch.float32)
    cases["prefill_bf16_d256_g4"] = lambda: prefill_case(13, hq=4, hkv=1, d=256, num_q=20, ctx=45,
                                                         dtype=torch.bfloat16)
    cases["prefill_f16_d96"] = lambda: prefill_case(14, hq=3, hkv=3, d=96, num_q=9, ctx=40, dtype=torch.float16)
    cases["prefill_f32_d8_context_only"] = lambda: prefill_case(15, hq=4, hkv=2, d=8, num_q=6, ctx=70,
                                                                dtype=torch.float32, causal=False)
    cases["prefill_f32_d64_unpaged_keys"] = lambda: prefill_case(16, hq=4, hkv=2, d=64, num_q=12, ctx=30,
                                                                 dtype=torch.float32, paged=False, causal=False)
    return cases


def group_layer() -> dict:
    from triton_layer_cases import layer_cases
    return layer_cases()


def group_cp() -> dict:
    """scripts/gpu_check.py's CP layouts (PCP 2/4 all-gather and ring, DCP 2, PCP x DCP; simulated ranks as threads)
    with the gqa-triton backend, against float64 over each request's whole sequence."""
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    import gpu_check

    cases = {}
    for dtype_name in gpu_check.DTYPES:
        for layout in gpu_check.CP_LAYOUTS:
            for step in gpu_check.CP_STEPS:
                def case(dtype_name=dtype_name, layout=layout, step=step):
                    pcp, dcp, strategy, interleave = gpu_check.CP_LAYOUTS[layout]
                    worst, writes_ok, _ = gpu_check.run_cp_layer(
                        gpu_check.CP_STEPS[step], pcp=pcp, dcp=dcp, strategy=strategy, interleave=interleave,
                        dtype=gpu_check.DTYPES[dtype_name], device=torch.device("cpu"), backend="gqa-triton")
                    return (worst if writes_ok else float("inf")), gpu_check.CP_TOL[dtype_name]
                cases[f"cp_{dtype_name}_{layout}_{step}"] = case
    return cases


GROUPS = {"decode": group_decode, "prefill": group_prefill, "layer": group_layer, "cp": group_cp}


def main(group: str) -> None:
    results = {}
    for name, case in GROUPS[group]().items():
        try:
            got = case()
            results[name] = list(got) if isinstance(got, tuple) else [got, TOL]
        except Exception:  # noqa: BLE001 - reported to the pytest process, which fails the case
            results[name] = traceback.format_exc(limit=4)
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1])
