"""Kimi delta attention's chunked rule on one layer of Kimi-Linear-48B's KDA shape (32 heads of 128, TP = 1), in one
process, the sides taking turns within every round (the side that goes first alternates):

- `pairwise`: one 64-token block's pairwise products (the system and the intra-block scores), by sub-blocks of
  8 tokens (cpllm/layers/kimi_delta/rule.py `_pairwise`, SUB = 8) against the explicit [64, 64, d_k] differences
  (the same function with one sub-block of 64: what transformers' torch path computes per block); outputs compared;
- `rule`: a whole --tokens prompt from a zero state, cpllm's chunked_kda (the C kernel, cpllm/kernels/kda_chunk.c),
  its torch form (`chunked_kda_torch`: the rule before the kernel, the fallback) and transformers'
  chunk_kimi_delta_attention (its pure-PyTorch path, the one it runs without flash-linear-attention), outputs
  compared, with GFLOP/s (delta_rule_bench.py's count) against the float32 GEMM ceiling of the same run;
- `step`: one decode token at batch 1 (cpllm/kernels/delta_step.c writing over the state as the layer has it, the
  torch form, transformers' recurrent_kimi_delta_attention), each call on the next of 16 states, GB/s of the
  state's read + write against the matvec ceiling of the same run.

    python benchmarks/kda_rule_bench.py --tokens 2048 --rounds 5 --threads 1 --out benchmarks/results/kda_rule.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from cpllm.bench.ceiling import matmul_gflops, matvec_gbps
from cpllm.layers.kimi_delta import rule
from delta_rule_bench import STATES, chunk_flops, rounds  # benchmarks/ is the script's folder

HEADS, HEAD_DIM, BLOCK = 32, 128, 64


def _timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def _turns(sides: dict, rounds: int) -> dict[str, list[float]]:
    """Each side once per round, the first side alternating; the first call of each is a warm-up."""
    for fn in sides.values():
        fn()
    times = {name: [] for name in sides}
    names = list(sides)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            times[name].append(_timed(sides[name])[0])
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers.models.kimi_linear.modeling_kimi_linear import (chunk_kimi_delta_attention,
                                                                      recurrent_kimi_delta_attention)

    gen = torch.Generator().manual_seed(0)
    h, d = HEADS, HEAD_DIM
    q, k = (rule.l2norm(torch.randn(h, BLOCK, d, generator=gen)) for _ in range(2))
    cum = (-torch.rand(h, BLOCK, d, generator=gen) * 0.5).cumsum(1)
    k_beta = k * torch.rand(h, BLOCK, 1, generator=gen)
    sides = {"sub-blocks of 8": lambda: rule._pairwise((k_beta, q), k, cum, sub=8),
             "explicit 64x64xd": lambda: rule._pairwise((k_beta, q), k, cum, sub=BLOCK)}
    pairwise = _turns(sides, args.rounds)
    diff = max((a - b).abs().max().item() for a, b in zip(*(fn() for fn in sides.values())))

    ceiling = [matmul_gflops(args.threads), matvec_gbps(args.threads)]
    t = args.tokens
    qq, kk, vv = (torch.randn(t, h, d, generator=gen) for _ in range(3))
    g = -torch.rand(t, h, d, generator=gen) * 0.5
    beta = torch.rand(t, h, generator=gen)
    zero = torch.zeros(h, d, d)
    qn, kn = rule.l2norm(qq) * d**-0.5, rule.l2norm(kk)
    prefill = {
        "kernel": lambda: rule.chunked_kda(qn, kn, vv, g, beta, zero)[0],
        "torch form": lambda: rule.chunked_kda_torch(qn, kn, vv, g, beta, zero)[0],
        "transformers": lambda: chunk_kimi_delta_attention(qq[None], kk[None], vv[None], g[None], beta[None],
                                                           use_qk_l2norm_in_kernel=True)[0][0],
    }
    rule_s = rounds(prefill, args.rounds)
    outs = {name: fn() for name, fn in prefill.items()}
    flops = chunk_flops(t, h, d, d)

    states = [torch.randn(1, h, d, d, generator=gen) * 0.01 for _ in range(STATES)]
    one = [x[:1][None] for x in (qq, kk, vv, g, beta)]  # [1, 1, ...]: one token of one request
    qs, ks = rule.l2norm(one[0][:, 0]) * d**-0.5, rule.l2norm(one[1][:, 0])
    turn = {"kernel": 0, "torch form": 0, "transformers": 0}

    def step(name, fn):
        def call():
            turn[name] = (turn[name] + 1) % STATES
            return fn(states[turn[name]])
        return call

    args5 = (qs, ks, one[2][:, 0], one[3][:, 0], one[4][:, 0])
    steps = {
        "kernel": step("kernel", lambda s: rule.recurrent_step(*args5, s, overwrite=True)),
        "torch form": step("torch form", lambda s: rule.recurrent_step_torch(*args5, s)),
        "transformers": step("transformers", lambda s: recurrent_kimi_delta_attention(
            *one, initial_state=s, output_final_state=True, use_qk_l2norm_in_kernel=True)),
    }
    step_s = rounds(steps, args.rounds, calls=50)
    probe = states[0].clone()
    step_diff = (rule.recurrent_step(*args5, probe.clone(), overwrite=True)[0]
                 - rule.recurrent_step_torch(*args5, probe)[0]).abs().max().item()
    ceiling += [matmul_gflops(args.threads), matvec_gbps(args.threads)]
    state_bytes = 2 * h * d * d * 4

    result = {"shape": {"heads": h, "head_dim": d, "block": BLOCK, "tokens": t}, "threads": args.threads,
              "rounds": args.rounds, "pairwise_s": {n: statistics.median(v) for n, v in pairwise.items()},
              "pairwise_max_abs_diff": diff,
              "ceiling_f32_gflops_before_after": ceiling[0::2], "ceiling_matvec_gbps_before_after": ceiling[1::2],
              "rule_s": rule_s, "rule_flops": flops, "rule_gflops": {n: flops / s / 1e9 for n, s in rule_s.items()},
              "rule_max_abs_diff": {n: (outs["kernel"] - outs[n]).abs().max().item()
                                    for n in ("torch form", "transformers")},
              "step_s": step_s, "step_state_gbps": {n: state_bytes / s / 1e9 for n, s in step_s.items()},
              "step_max_abs_diff_vs_torch_form": step_diff}
    result["pairwise_ratio"] = result["pairwise_s"]["explicit 64x64xd"] / result["pairwise_s"]["sub-blocks of 8"]
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
