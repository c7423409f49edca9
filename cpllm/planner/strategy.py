"""`--cp-prefill-strategy auto`: the ring (pass-KV) or pass-Q, whichever the cost model predicts is faster; on a host
whose ranks all-gather through shared memory (the CPU's spec), the all-gather too.

The decision is the one `cpllm plan` makes for a request (plan.py), from the same CostModel: per step, the
predicted prefill time of the step's prompt chunks under each strategy cpllm runs, and the smaller wins (the
ring on a tie). What differs between the two is only their communication and how much of it the attention of
the block in hand hides (cost_model.py):

- ring: the new K/V go round the PCP ring behind the new-token attention; a cached context is served by a
  blocking query gather over the CP group and a blocking all-to-all of the partials;
- pass-Q: the queries go round the ring behind all of the attention (cached part included); one blocking
  all-to-all returns the partials and brings the new K/V to their owners.

So a fresh long prompt takes the ring (pass-Q would add the all-to-all and gain nothing), and a short chunk on a
long cached context takes pass-Q (the ring would add the query gather, which nothing hides). On a CPU host the
all-gather of the new K/V runs through shared memory and leaves each PCP rank one attention call with no merge,
while the ring's second call and merge cost memory traffic (the spec's `attention_row_traffic`): fresh prompts take
the all-gather there.

The paper's closed form (paper_rule.py) models the paper's pass-KV, which rings the cached K/V too; cpllm's ring
does not, so the rule picks the ring for chunks cpllm runs faster with pass-Q (256 new tokens on 4,096 cached on
this machine).

The choice is a pure function of the step and the configuration, so every rank makes the same one without
talking. Steps without a prompt chunk (decodes only) and layouts without PCP need no choice.
"""

from __future__ import annotations

from dataclasses import dataclass

from cpllm.distributed.parallel_dims import ParallelDims
from cpllm.planner.cost_model import CostModel

PASS_KV = "ring"
PASS_Q = "pass-q"
ALL_GATHER = "allgather"
ENGINE_CHOICES = (PASS_KV, PASS_Q)
"""What `auto` chooses between everywhere: the strategies cpllm runs (the cost model's names for them)."""
SHARED_MEMORY_CHOICES = (*ENGINE_CHOICES, ALL_GATHER)
"""What `auto` chooses between where one node's all-gathers go through shared memory (CPU hosts): there the new K/V
all-gathered also leave each PCP rank one attention call for its head and tail runs, with no merge."""


@dataclass(kw_only=True, frozen=True, slots=True)
class StepSizes:
    """What the scheduler knows about one step's prompt chunks."""

    new: int
    """T: new tokens of the chunks with more than one token."""
    cached: int
    """P: tokens those chunks' requests have cached already."""


def step_sizes(chunks) -> StepSizes:
    """Sizes of a step's prompt chunks (single-token chunks are decodes: they never travel round a ring).

    Several chunks are summed into one (T, P): the prediction then counts their attention as one request's,
    a little more than the sum of theirs, which moves both strategies alike.
    """
    prompt = [c for c in chunks if len(c.token_ids) > 1]
    return StepSizes(new=sum(len(c.token_ids) for c in prompt), cached=sum(c.start_pos for c in prompt))


@dataclass(kw_only=True, frozen=True, slots=True)
class StrategyChoice:
    """The pick and the predictions it came from."""

    strategy: str
    predicted_s: dict[str, float]
    """Predicted prefill seconds of the step (whole model) per candidate."""


def engine_choices(cost: CostModel) -> tuple[str, ...]:
    """The strategies `auto` weighs on this cost model's hardware."""
    return SHARED_MEMORY_CHOICES if cost.hw.shared_memory_bw is not None else ENGINE_CHOICES


def choose(cost: CostModel, layout: ParallelDims, sizes: StepSizes,
           candidates: tuple[str, ...] | None = None) -> StrategyChoice:
    """The candidate (None: `engine_choices`) with the smallest predicted prefill time (the first one on a tie)."""
    candidates = engine_choices(cost) if candidates is None else candidates
    if sizes.new <= 0:
        raise ValueError(f"no prompt tokens in the step (T={sizes.new}): nothing to choose")
    if layout.pcp <= 1:
        raise ValueError(f"PCP={layout.pcp}: without context parallelism there is no strategy to choose")
    predicted = {name: cost.prefill(layout, sizes.new, sizes.cached, name).total_s for name in candidates}
    best = min(candidates, key=lambda name: predicted[name])  # min keeps the first of equal ones
    return StrategyChoice(strategy=best, predicted_s=predicted)
