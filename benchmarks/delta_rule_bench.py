"""The gated delta rule on one DeltaNet layer of Qwen3-Next's shape (32 value heads of 128 x 128, TP = 1), in one
process, the two sides taking turns within every round: cpllm's chunked rule (cpllm/layers/gated_delta/rule.py
`chunked_delta_rule`) against transformers' torch path (`torch_chunk_gated_delta_rule`, what it runs without
flash-linear-attention) on the same q, k, v, decays and betas from a zero state; and one decode token's recurrent
step against transformers' `torch_recurrent_gated_delta_rule`. Medians of the rounds; outputs compared.

    python benchmarks/delta_rule_bench.py --tokens 2048 --rounds 5 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers.models.qwen3_next.modeling_qwen3_next import (torch_chunk_gated_delta_rule,
                                                                torch_recurrent_gated_delta_rule)

from cpllm.layers.gated_delta.rule import chunked_delta_rule, l2norm, recurrent_step

HEADS, HEAD_DIM = 32, 128


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    t, h, d = args.tokens, HEADS, HEAD_DIM
    q, k, v = (torch.randn(1, t, h, d) for _ in range(3))
    g, beta = -torch.rand(1, t, h) * 0.5, torch.rand(1, t, h)
    qn, kn = l2norm(q[0]) * d**-0.5, l2norm(k[0])
    sides = {
        "cpllm": lambda: chunked_delta_rule(qn, kn, v[0], g[0], beta[0], torch.zeros(h, d, d))[0],
        "transformers": lambda: torch_chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0][0],
    }
    times = {name: [] for name in sides}
    outs = {}
    for r in range(args.rounds):
        for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):  # the side going first alternates
            start = time.perf_counter()
            outs[name] = sides[name]()
            times[name].append(time.perf_counter() - start)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    diff = (outs["cpllm"] - outs["transformers"]).abs().max().item()
    print(f"prefill, {t} tokens x {h} heads, {args.threads} thread(s): cpllm {med['cpllm'] * 1e3:.0f} ms, "
          f"transformers {med['transformers'] * 1e3:.0f} ms, ratio {med['transformers'] / med['cpllm']:.2f}x; "
          f"max |diff| {diff:.1e}")
    state = torch.randn(1, h, d, d) * 0.01
    one = [x[:, :1] for x in (q, k, v, g, beta)]
    qs, ks = l2norm(one[0]) * d**-0.5, l2norm(one[1])
    steps = {
        "cpllm": lambda: recurrent_step(qs[:, 0], ks[:, 0], one[2][:, 0], one[3][:, 0], one[4][:, 0], state),
        "transformers": lambda: torch_recurrent_gated_delta_rule(one[0], one[1], one[2], one[3], one[4],
                                                                 initial_state=state, output_final_state=True,
                                                                 use_qk_l2norm_in_kernel=True),
    }
    step_times = {name: [] for name in steps}
    for r in range(args.rounds):
        for name in (list(steps) if r % 2 == 0 else list(steps)[::-1]):
            step_times[name].append(_per_call(steps[name], 100))
    ours, theirs = (statistics.median(step_times[name]) for name in steps)
    print(f"decode step, batch 1: cpllm {ours * 1e6:.0f} us, transformers {theirs * 1e6:.0f} us, "
          f"ratio {theirs / ours:.2f}x")


def _per_call(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


if __name__ == "__main__":
    main()
