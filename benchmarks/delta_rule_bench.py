"""The gated delta rule on one DeltaNet layer of Qwen3-Next's shape (32 value heads of 128 x 128, TP = 1), in
one process, the sides taking turns within every round (the side going first rotates): cpllm's chunked rule (the
C kernel, cpllm/kernels/delta_chunk.c), its torch form (`chunked_delta_rule_torch`: the rule before the kernel,
the fallback) and transformers' torch path (`torch_chunk_gated_delta_rule`, what it runs without
flash-linear-attention) on the same q, k, v, decays and betas from a zero state; and one decode token's recurrent
step at batch 1 (cpllm/kernels/delta_step.c writing over the state as the layer has it, its torch form,
transformers' `torch_recurrent_gated_delta_rule`), each call on the next of 16 states (32 MiB: past a core's
2 MiB of L2, in the L3, where a model's states at batch 1 lie). GFLOP/s of the chunked rule and GB/s of the step's
state read + write against `cpllm bench ceiling`'s float32 GEMM and matvec rates, measured in the same run before
and after. Medians of the rounds; outputs compared.

    python benchmarks/delta_rule_bench.py --tokens 2048 --rounds 5 --threads 1 --out benchmarks/results/delta_rule.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from cpllm.bench.ceiling import matmul_gflops, matvec_gbps

HEADS, HEAD_DIM, CHUNK, STATES = 32, 128, 64, 16


def chunk_flops(tokens: int, heads: int, dk: int, dv: int, chunk: int = CHUNK) -> float:
    """Multiply-adds x 2 of the WY form per block of `chunk` (the pairwise k k^T and q k^T over full blocks, the
    triangular solve, w S, q S, P v', k^T v'), over all heads and blocks; exps and elementwise ops not counted."""
    c = chunk
    per_block = 4 * c * c * dk + c * c * (dk + dv) + 2 * c * c * dv + 6 * c * dk * dv
    return float(heads * -(-tokens // c) * per_block)


def rounds(sides: dict, count: int, calls: int = 1) -> dict[str, float]:
    """Median seconds per call of each side over `count` rounds, the first side rotating; one warm-up call each."""
    for fn in sides.values():
        fn()
    times = {name: [] for name in sides}
    names = list(sides)
    for r in range(count):
        for name in names[r % len(names):] + names[: r % len(names)]:
            start = time.perf_counter()
            for _ in range(calls):
                sides[name]()
            times[name].append((time.perf_counter() - start) / calls)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers.models.qwen3_next.modeling_qwen3_next import (torch_chunk_gated_delta_rule,
                                                                    torch_recurrent_gated_delta_rule)

    from cpllm.layers.gated_delta.rule import (chunked_delta_rule, chunked_delta_rule_torch, l2norm, recurrent_step,
                                               recurrent_step_torch)

    ceiling = [matmul_gflops(args.threads), matvec_gbps(args.threads)]
    torch.manual_seed(0)
    t, h, d = args.tokens, HEADS, HEAD_DIM
    q, k, v = (torch.randn(1, t, h, d) for _ in range(3))
    g, beta = -torch.rand(1, t, h) * 0.5, torch.rand(1, t, h)
    qn, kn = l2norm(q[0]) * d**-0.5, l2norm(k[0])
    zero = torch.zeros(h, d, d)
    prefill = {
        "kernel": lambda: chunked_delta_rule(qn, kn, v[0], g[0], beta[0], zero)[0],
        "torch form": lambda: chunked_delta_rule_torch(qn, kn, v[0], g[0], beta[0], zero)[0],
        "transformers": lambda: torch_chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0][0],
    }
    prefill_s = rounds(prefill, args.rounds)
    outs = {name: fn() for name, fn in prefill.items()}
    flops = chunk_flops(t, h, d, d)

    states = [torch.randn(1, h, d, d) * 0.01 for _ in range(STATES)]
    one = [x[:, :1] for x in (q, k, v, g, beta)]
    qs, ks = l2norm(one[0][:, 0]) * d**-0.5, l2norm(one[1][:, 0])
    turn = {"kernel": 0, "torch form": 0, "transformers": 0}

    def step(name, fn):
        def call():
            turn[name] = (turn[name] + 1) % STATES
            return fn(states[turn[name]])
        return call

    steps = {
        "kernel": step("kernel", lambda s: recurrent_step(qs, ks, one[2][:, 0], one[3][:, 0], one[4][:, 0], s,
                                                          overwrite=True)),  # as the layer calls it
        "torch form": step("torch form", lambda s: recurrent_step_torch(qs, ks, one[2][:, 0], one[3][:, 0],
                                                                        one[4][:, 0], s)),
        "transformers": step("transformers", lambda s: torch_recurrent_gated_delta_rule(
            one[0], one[1], one[2], one[3], one[4], initial_state=s, output_final_state=True,
            use_qk_l2norm_in_kernel=True)),
    }
    step_s = rounds(steps, args.rounds, calls=50)
    probe = states[0].clone()
    step_diff = (recurrent_step(qs, ks, one[2][:, 0], one[3][:, 0], one[4][:, 0], probe.clone(), overwrite=True)[0]
                 - recurrent_step_torch(qs, ks, one[2][:, 0], one[3][:, 0], one[4][:, 0], probe)[0]).abs().max().item()
    ceiling += [matmul_gflops(args.threads), matvec_gbps(args.threads)]
    state_bytes = 2 * h * d * d * 4  # one read and one write of the layer's states
    result = {
        "shape": {"heads": h, "dk": d, "dv": d, "tokens": t}, "threads": args.threads, "rounds": args.rounds,
        "ceiling_f32_gflops_before_after": ceiling[0::2], "ceiling_matvec_gbps_before_after": ceiling[1::2],
        "prefill_s": prefill_s, "prefill_flops": flops,
        "prefill_gflops": {n: flops / s / 1e9 for n, s in prefill_s.items()},
        "prefill_max_abs_diff": {n: (outs["kernel"] - outs[n]).abs().max().item() for n in ("torch form",
                                                                                             "transformers")},
        "step_s": step_s, "step_state_gbps": {n: state_bytes / s / 1e9 for n, s in step_s.items()},
        "step_max_abs_diff_vs_torch_form": step_diff,
    }
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
