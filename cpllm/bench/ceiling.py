"""The machine's ceilings and the work a prefill does.

- `matmul_gflops`: the measured float32 rate of a large `torch.matmul` (the compute ceiling); with `dtype`, the
  bfloat16 matmul's or the int8 one's (`torch._int_mm`, int32 sums), the rates a bf16 or int8 tile path could
  reach on this CPU (on one without AVX-512 BF16 / VNNI / AMX both run far below float32).
- `matvec_gbps`: the measured rate at which a matrix-vector product streams fp32 weights
  (the memory ceiling that bounds batch-1 decode).
- `prefill_flops`: 2 * (linear weights) * tokens, plus causal attention, plus the LM head
  for the rows that get logits (cpllm: the last prompt token; transformers: every position).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(kw_only=True, frozen=True, slots=True)
class PrefillFlops:
    """Floating-point operations of one prefill, split by where they go."""

    linear: float
    """Projections and MLP of every layer: 2 * weights * tokens."""
    attention: float
    """Causal QK^T and PV: 2 * 2 * head_dim * heads * T(T+1)/2 per layer."""
    lm_head: float
    """2 * hidden * vocab per row that gets logits."""

    @property
    def total(self) -> float:
        return self.linear + self.attention + self.lm_head


def linear_params_per_layer(config: Any) -> float:
    """Weights of one decoder layer's matmuls that a token passes through (norms and biases are negligible);
    for a MoE model, its top-k experts and the shared expert, averaged over sparse and dense layers."""
    h, d = config.hidden_size, config.head_dim
    q_and_o = 2 * h * config.num_attention_heads * d
    k_and_v = 2 * h * config.num_key_value_heads * d
    mlp = 3 * h * mlp_width_per_token(config)
    return q_and_o + k_and_v + mlp


def mlp_width_per_token(config: Any) -> float:
    """Gated-MLP rows one token multiplies per layer: intermediate_size (dense), or top-k experts' rows plus the
    shared expert's in sparse layers, averaged over the layers."""
    moe = getattr(config, "moe", None)
    if moe is None:
        return config.intermediate_size
    layers = config.num_hidden_layers
    sparse = sum(moe.is_sparse(i) for i in range(layers))
    routed = moe.top_k * moe.intermediate_size + moe.shared_expert_intermediate_size
    return (sparse * routed + (layers - sparse) * config.intermediate_size) / layers


def weight_bytes_per_decode_step(config: Any, dtype_bytes: int = 4) -> int:
    """Bytes of weights one decode step reads: every layer's matmuls plus the LM head."""
    layers = linear_params_per_layer(config) * config.num_hidden_layers
    return (layers + config.hidden_size * config.vocab_size) * dtype_bytes


def prefill_flops(config: Any, tokens: int, *, logits_rows: int = 1) -> PrefillFlops:
    """FLOPs of a prefill of `tokens` new tokens with no cached context."""
    layers = config.num_hidden_layers
    linear = 2.0 * linear_params_per_layer(config) * tokens * layers
    pairs = tokens * (tokens + 1) / 2  # causal (query, key) pairs
    attention = 2 * 2.0 * config.head_dim * config.num_attention_heads * pairs * layers
    lm_head = 2.0 * config.hidden_size * config.vocab_size * logits_rows
    return PrefillFlops(linear=linear, attention=attention, lm_head=lm_head)


def _with_threads(threads: int | None):
    class _Threads:
        def __enter__(self):
            self.saved = torch.get_num_threads()
            if threads:
                torch.set_num_threads(threads)

        def __exit__(self, *exc):
            torch.set_num_threads(self.saved)

    return _Threads()


def matmul_gflops(threads: int | None = None, *, size: int = 2048, repeats: int = 5,
                  dtype: torch.dtype = torch.float32) -> float:
    """Best-of-`repeats` GFLOP/s (int8: GOP/s) of a [size, size] @ [size, size] matmul in `dtype` (float32,
    bfloat16, or int8 through torch._int_mm)."""
    if dtype not in (torch.float32, torch.bfloat16, torch.int8):
        raise ValueError(f"matmul_gflops: dtype {dtype}; measured are float32, bfloat16 and int8")
    if dtype == torch.int8:
        a, b = (torch.randint(-127, 128, (size, size), dtype=torch.int8) for _ in range(2))
        multiply = torch._int_mm
    else:
        a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
        multiply = torch.matmul
    best = float("inf")
    with _with_threads(threads):
        multiply(a, b)  # warm-up: thread pool, page faults
        for _ in range(repeats):
            start = time.perf_counter()
            multiply(a, b)
            best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / best / 1e9


def matvec_gbps(threads: int | None = None, *, megabytes: int = 256, repeats: int = 5) -> float:
    """Best-of-`repeats` GB/s of a float32 matrix-vector product over `megabytes` of weights."""
    cols = 2048
    rows = megabytes * 2**20 // (4 * cols)
    w, x = torch.randn(rows, cols), torch.randn(cols)
    best = float("inf")
    with _with_threads(threads):
        torch.mv(w, x)
        for _ in range(repeats):
            start = time.perf_counter()
            torch.mv(w, x)
            best = min(best, time.perf_counter() - start)
    return w.numel() * 4 / best / 1e9


LOW_PRECISION_SIZE = 1024
"""Matmul side for the bf16 and int8 rates: where the CPU has no tiles for them they run ~50x below float32, and
2048 would take minutes."""


def measure_ceilings(thread_counts: list[int], *, size: int = 2048,
                     low_precision: bool = False) -> dict[int, dict[str, float]]:
    """{threads: {"matmul_gflops": ..., "matvec_gbps": ...}} for each thread count; with `low_precision`, also
    "bf16_matmul_gflops" and "int8_matmul_gops" (at a side of at most LOW_PRECISION_SIZE, best of 2)."""
    ceilings = {
        t: {"matmul_gflops": round(matmul_gflops(t, size=size), 2), "matvec_gbps": round(matvec_gbps(t), 2)}
        for t in thread_counts
    }
    if low_precision:
        side = min(size, LOW_PRECISION_SIZE)
        for t in thread_counts:
            ceilings[t]["bf16_matmul_gflops"] = round(matmul_gflops(t, size=side, repeats=2, dtype=torch.bfloat16), 2)
            ceilings[t]["int8_matmul_gops"] = round(matmul_gflops(t, size=side, repeats=2, dtype=torch.int8), 2)
    return ceilings
