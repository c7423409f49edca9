"""The execution plan of one step: which path its layers take, decided once per step by the runner.

The runner picks the plan from the step's chunks and this rank's fixed facts (its layout, whether fused decode
layers or a decode team exist); `build_step_batch` lays the metadata out for it and carries it in
`AttentionMetadata.plan`. Everything downstream (the fused layers, the compiled step, PagedCPAttention) follows
that value and never re-derives it. Which implementation a backend runs inside a path (a C kernel, SDPA, the
CUDA kernels) changes neither the plan nor the metadata's layout: decode rows always carry each request's own
slots, and a backend whose implementation reads shared keys once builds that view itself, once per step
(metadata.py, `shared_key_view`).
"""

from __future__ import annotations

import enum


class StepPlan(str, enum.Enum):
    """The path one step takes through the decoder layers (the value names it in logs and `plan_counts`)."""

    PREFILL = "prefill"
    """Some chunk has several new tokens (a prompt chunk, or a verify chunk of speculative decoding: a running
    request's last token and its drafts, cpllm/step.py): eager layers, the new tokens moved over PCP by the step's strategy
    (`AttentionMetadata.strategy`), single tokens of the step attended to the context beside them."""
    FUSED = "fused"
    """Single tokens only, one C call per decoder layer on this rank alone (cpllm/model/fused_decode.py)."""
    PCP_TEAM = "pcp-team"
    """Single tokens only, fused layers run by the PCP ranks of one host as a team (cpllm/model/decode_team.py):
    every row on every member, each request's own context slots."""
    TP_TEAM = "tp-team"
    """As PCP_TEAM, the team being the TP ranks (PCP = 1), each running its weight shards."""
    COMPILED = "compiled"
    """Single tokens only, each layer one torch.compile graph (cpllm/model/decode_graph.py); a rank holding its
    replica alone."""
    ONE_SHARD = "one-shard"
    """Single tokens only, eager layers, each request's whole context in this rank's pools: store, then one
    decode-row attention call (no collective)."""
    PCP_DECODE = "pcp-decode"
    """Single tokens only, eager layers, sharded layout over PCP without DCP: every rank attends every query to its
    shard and one all-gather brings the partials to merge."""
    GATHERED_DECODE = "gathered-decode"
    """Single tokens only, eager layers, context over DCP (or PCP x DCP): queries all-gathered over the KV-shard
    group, partials returned by one all-to-all and merged."""

    @property
    def fused(self) -> bool:
        """The layers run as fused C calls (alone or as a team)."""
        return self in (StepPlan.FUSED, StepPlan.PCP_TEAM, StepPlan.TP_TEAM)

    @property
    def team(self) -> bool:
        """The ranks of a decode team run the step together (every row on every member)."""
        return self in (StepPlan.PCP_TEAM, StepPlan.TP_TEAM)


def eager_decode_plan(kv_shards: int, pcp_size: int, replicated: bool) -> StepPlan:
    """The eager layers' path for a step of single tokens: `kv_shards` ranks hold one request's context (the
    DCP group under the replicated layout, PCP x DCP under the sharded one)."""
    if kv_shards == 1:
        return StepPlan.ONE_SHARD
    if not replicated and kv_shards == pcp_size:  # no DCP: every PCP rank holds every query already
        return StepPlan.PCP_DECODE
    return StepPlan.GATHERED_DECODE


def single_token_homes(request_ids, pcp_size: int) -> list[int]:
    """The PCP rank computing each single token of a decode-only step where each goes to one rank (the replicated
    layout outside a team): the rank with the fewest rows so far (lowest on ties), except that a token of the same
    request as the one before it (the rows of one verify chunk, cpllm/worker/runner.py `_verify_rows`) stays on that
    one's rank. In such a step each copy stores only the K/V it computed (the others arrive after the step,
    replica_sync.py), and row i of a verify chunk reads rows < i in the same layer, so they must be computed where
    they are read. metadata `_rank_runs` deals them so."""
    rows, homes, previous = [0] * pcp_size, [], None
    for request_id in request_ids:
        home = homes[-1] if homes and request_id == previous else min(range(pcp_size), key=lambda p: (rows[p], p))
        rows[home] += 1
        homes.append(home)
        previous = request_id
    return homes


def single_token_rows(num_tokens: int, pcp_size: int, pcp_rank: int, split: bool,
                      request_ids=None) -> tuple[int, int]:
    """(rows this rank computes, rows of every rank's batch) for a step of `num_tokens` single tokens; `split`:
    each token on one PCP rank (the replicated layout outside a team; `single_token_homes`, by `request_ids`, one
    request per token where None)."""
    if not split:
        return num_tokens, num_tokens
    homes = single_token_homes(range(num_tokens) if request_ids is None else request_ids, pcp_size)
    counts = [homes.count(p) for p in range(pcp_size)]
    return counts[pcp_rank], max(counts)
