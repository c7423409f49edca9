"""The closed-form rule of Yang et al. (arXiv 2411.01783, Algorithm 1) for pass-KV against pass-Q.

With T the new tokens of a step's prompt chunks, P their cached tokens, N the PCP ranks, C one rank's attention
FLOP/s, BW its bandwidth to the next PCP rank, e the bytes per element and N_KV, N_H the KV and query heads one
rank holds:

    pass-KV  if  T >= N * C * N_KV * e / (2 * N_H * BW)     (a K/V block arrives before its attention ends)
             or  T / (T + P) >= 2 * N_KV / N_H               (the K/V message is no larger than the queries')
    pass-Q   otherwise

Derivation (docs/context_parallel.md): a pass-KV ring step moves the K/V of (T + P) / N tokens,
2 N_KV D e (T + P) / N bytes, while its attention does 4 D N_H (T / N)(T + P) / N FLOPs; the transfer hides when
bytes / BW <= FLOPs / C, i.e. the first line. A pass-Q step moves T / N queries, N_H D e T / N bytes; pass-KV's
message is the smaller when 2 N_KV (T + P) <= N_H T, the second line.

cpllm does not decide with this rule: its ring moves only the new K/V and serves the cached context with a
blocking query gather, which the rule does not know about, so `auto` compares the cost model's predictions
instead (strategy.py). The rule stays as the paper's reference: tests check it against the paper's Table 4.
"""

from __future__ import annotations

from dataclasses import dataclass

from cpllm.planner.strategy import PASS_KV, PASS_Q, StepSizes


@dataclass(kw_only=True, frozen=True, slots=True)
class HeuristicInputs:
    """The constants of the rule for one layout on one kind of device."""

    pcp: int
    """N: ranks of the ring."""
    flops: float
    """C: attention FLOP/s of one rank."""
    bandwidth: float
    """BW: bytes/s from one rank to the next PCP rank."""
    kv_heads: int
    """N_KV held by one rank."""
    query_heads: int
    """N_H held by one rank."""
    element_bytes: int
    """e: bytes per K, V or Q element."""

    @property
    def overlap_threshold(self) -> float:
        """Smallest T whose pass-KV ring hides behind attention."""
        return self.pcp * self.flops * self.kv_heads * self.element_bytes / (
            2 * self.query_heads * self.bandwidth)

    @property
    def miss_rate_threshold(self) -> float:
        """Smallest T / (T + P) at which the K/V message is no larger than the queries'."""
        return 2 * self.kv_heads / self.query_heads


def paper_choice(sizes: StepSizes, inputs: HeuristicInputs) -> str:
    """"ring" (pass-KV) or "pass-q" by the paper's rule."""
    if sizes.new <= 0:
        raise ValueError(f"no prompt tokens in the step (T={sizes.new}): nothing to choose")
    if sizes.new >= inputs.overlap_threshold:
        return PASS_KV
    if sizes.new / (sizes.new + sizes.cached) >= inputs.miss_rate_threshold:
        return PASS_KV
    return PASS_Q
