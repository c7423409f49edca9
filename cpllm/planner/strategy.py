"""`--cp-prefill-strategy auto`: pass-KV (the ring) or pass-Q, chosen per step from the step's sizes.

The rule of Yang et al. (arXiv 2411.01783, Algorithm 1), with T the new tokens of the step's prompt chunks,
P their cached tokens, N the PCP ranks, C one rank's attention FLOP/s, BW its bandwidth to the next PCP rank,
e the bytes per element and N_KV, N_H the KV and query heads one rank holds:

    pass-KV  if  T >= N * C * N_KV * e / (2 * N_H * BW)     (a K/V block arrives before its attention ends)
             or  T / (T + P) >= 2 * N_KV / N_H               (the K/V message is no larger than the queries')
    pass-Q   otherwise

Derivation (docs/context_parallel.md): a pass-KV ring step moves the K/V of (T + P) / N tokens,
2 N_KV D e (T + P) / N bytes, while its attention does 4 D N_H (T / N)(T + P) / N FLOPs; the transfer hides when
bytes / BW <= FLOPs / C, i.e. the first line. A pass-Q step moves T / N queries, N_H D e T / N bytes; pass-KV's
message is the smaller when 2 N_KV (T + P) <= N_H T, the second line. The decision is a pure function of the
step, so every rank makes the same one without talking. Steps without a prompt chunk (decodes only) and
layouts without PCP need no choice.
"""

from __future__ import annotations

from dataclasses import dataclass

PASS_KV = "ring"
PASS_Q = "pass-q"


@dataclass(kw_only=True, frozen=True, slots=True)
class StepSizes:
    """What the scheduler knows about one step's prompt chunks."""

    new: int
    """T: new tokens of the chunks with more than one token."""
    cached: int
    """P: tokens those chunks' requests have cached already."""


def step_sizes(chunks) -> StepSizes:
    """Sizes of a step's prompt chunks (single-token chunks are decodes: they never travel round a ring)."""
    prompt = [c for c in chunks if len(c.token_ids) > 1]
    return StepSizes(new=sum(len(c.token_ids) for c in prompt), cached=sum(c.start_pos for c in prompt))


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


def choose(sizes: StepSizes, inputs: HeuristicInputs) -> str:
    """"ring" (pass-KV) or "pass-q" for a step with prompt chunks."""
    if sizes.new <= 0:
        raise ValueError(f"no prompt tokens in the step (T={sizes.new}): nothing to choose")
    if sizes.new >= inputs.overlap_threshold:
        return PASS_KV
    if sizes.new / (sizes.new + sizes.cached) >= inputs.miss_rate_threshold:
        return PASS_KV
    return PASS_Q
