"""Kimi delta attention's chunked rule on one layer of Kimi-Linear-48B's KDA shape (32 heads of 128, TP = 1), in one
process, the sides taking turns within every round (the side that goes first alternates):

- `pairwise`: one 64-token block's pairwise products (the system and the intra-block scores), by sub-blocks of
  8 tokens (cpllm/layers/kimi_delta/rule.py `_pairwise`, SUB = 8) against the explicit [64, 64, d_k] differences
  (the same function with one sub-block of 64: what transformers' torch path computes per block); outputs compared;
- `rule`: a whole --tokens prompt from a zero state, cpllm's chunked_kda against transformers'
  chunk_kimi_delta_attention (its pure-PyTorch path, the one it runs without flash-linear-attention), outputs
  compared.

    python benchmarks/kda_rule_bench.py --tokens 256 --rounds 3 --threads 2 --out benchmarks/results/kda_rule.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from cpllm.layers.kimi_delta import rule

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
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention

    gen = torch.Generator().manual_seed(0)
    h, d = HEADS, HEAD_DIM
    q, k = (rule.l2norm(torch.randn(h, BLOCK, d, generator=gen)) for _ in range(2))
    cum = (-torch.rand(h, BLOCK, d, generator=gen) * 0.5).cumsum(1)
    k_beta = k * torch.rand(h, BLOCK, 1, generator=gen)
    sides = {"sub-blocks of 8": lambda: rule._pairwise((k_beta, q), k, cum, sub=8),
             "explicit 64x64xd": lambda: rule._pairwise((k_beta, q), k, cum, sub=BLOCK)}
    pairwise = _turns(sides, args.rounds)
    diff = max((a - b).abs().max().item() for a, b in zip(*(fn() for fn in sides.values())))

    t = args.tokens
    qq, kk, vv = (torch.randn(t, h, d, generator=gen) for _ in range(3))
    g = -torch.rand(t, h, d, generator=gen) * 0.5
    beta = torch.rand(t, h, generator=gen)
    zero = torch.zeros(h, d, d)
    ours = lambda: rule.chunked_kda(rule.l2norm(qq) * d**-0.5, rule.l2norm(kk), vv, g, beta, zero)  # noqa: E731
    theirs = lambda: chunk_kimi_delta_attention(qq[None], kk[None], vv[None], g[None], beta[None],  # noqa: E731
                                                use_qk_l2norm_in_kernel=True)
    whole = _turns({"cpllm chunked_kda": ours, "transformers chunk_kimi_delta_attention": theirs}, args.rounds)
    rule_diff = (ours()[0] - theirs()[0][0]).abs().max().item()

    result = {"shape": {"heads": h, "head_dim": d, "block": BLOCK, "tokens": t}, "threads": args.threads,
              "rounds": args.rounds, "pairwise_s": {n: statistics.median(v) for n, v in pairwise.items()},
              "pairwise_max_abs_diff": diff, "rule_s": {n: statistics.median(v) for n, v in whole.items()},
              "rule_max_abs_diff": rule_diff}
    result["pairwise_ratio"] = result["pairwise_s"]["explicit 64x64xd"] / result["pairwise_s"]["sub-blocks of 8"]
    result["rule_ratio"] = (result["rule_s"]["transformers chunk_kimi_delta_attention"]
                            / result["rule_s"]["cpllm chunked_kda"])
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
