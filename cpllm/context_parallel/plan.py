"""The execution plan of one step: a record of every path choice its layers follow, built once per step by
`plan_step` from the step's chunks and the rank's capabilities (`RankCapabilities`, computed once at start-up:
cpllm/worker/rank_capabilities.py).

`build_step_batch` lays the metadata out for the plan and carries it in `AttentionMetadata.plan`. Everything
downstream reads that record and never re-derives a choice: the decoder stack runs fused exactly when
`plan.fused`, the runner the compiled step or a CUDA graph replay exactly when the plan says so, the dense MLPs
split over PCP exactly when `plan.mlp_split`, the replicated layout's K/V sync runs exactly when
`plan.replica_sync`, and PagedCPAttention branches on `plan.path`. Which implementation a backend runs inside a
path (a C kernel, SDPA, the CUDA kernels) changes neither the plan nor the metadata's layout: decode rows always
carry each request's own slots, and a backend whose implementation reads shared keys once builds that view itself,
once per step (cached in the batch's `StepViews`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class StepPath(str, enum.Enum):
    """The path one step takes through the decoder layers (the value names it in logs and `plan_counts`)."""

    PREFILL = "prefill"
    """Some chunk has several new tokens (a prompt chunk, or a verify chunk of speculative decoding: a running
    request's last token and its drafts, cpllm/step.py): eager layers, the new tokens moved over PCP by the step's
    strategy (`StepPlan.strategy`), single tokens of the step attended to the context beside them."""
    FUSED = "fused"
    """Single tokens only, one C call per decoder layer on this rank alone (cpllm/model/execution/fused_decode.py)."""
    PCP_TEAM = "pcp-team"
    """Single tokens only, fused layers run by the PCP ranks of one host as a team (cpllm/model/execution/decode_team.py):
    every row on every member, each request's own context slots."""
    TP_TEAM = "tp-team"
    """As PCP_TEAM, the team being the TP ranks (PCP = 1), each running its weight shards."""
    COMPILED = "compiled"
    """Single tokens only, each layer one torch.compile graph (cpllm/model/execution/decode_graph.py); a rank holding its
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
        return self in (StepPath.FUSED, StepPath.PCP_TEAM, StepPath.TP_TEAM)

    @property
    def team(self) -> bool:
        """The ranks of a decode team run the step together (every row on every member)."""
        return self in (StepPath.PCP_TEAM, StepPath.TP_TEAM)


_EAGER_DECODE = (StepPath.ONE_SHARD, StepPath.PCP_DECODE, StepPath.GATHERED_DECODE)


@dataclass(kw_only=True, frozen=True, slots=True)
class StepPlan:
    """Every path choice of one step, made once by `plan_step` (the defaults: nothing but the path's eager
    layers, as a hand-built plan of a test or a captured graph wants)."""

    path: StepPath
    """Which way the step goes through the decoder layers."""
    strategy: str | None = None
    """How a prefill step moves the new K/V over PCP ("allgather", "ring", "pass-q"; the runner's per-step choice,
    cpllm/planner/runtime.py); None: a step of single tokens, or the layer's configured strategy."""
    split_single_tokens: bool = False
    """Each single token is computed on one PCP rank only (the replicated layout outside a team:
    `single_token_homes`), instead of on every PCP rank."""
    replica_sync: bool = False
    """After the forward, the K/V of the decode rows reach the other PCP copies (cpllm/context_parallel/
    replica_sync.py): a step of split single tokens, each computed and stored by one copy only."""
    graph_bucket: int | None = None
    """The captured CUDA graph (its batch size) the step replays (cpllm/model/execution/cuda_graphs.py); None: eager."""
    mlp_split: bool = False
    """The dense MLPs compute 1/PCP of their columns each and gather them (cpllm/model/mlp_split.py): every PCP
    rank holds the same rows of single tokens on the eager layers."""
    lm_head_split: bool = False
    """Every PCP rank computes a share of the vocabulary's logits (cpllm/model/layers.py `ParallelLMHead`); else
    PCP rank 0 alone runs the LM head."""

    @property
    def value(self) -> str:
        """The path's name, as logs and `plan_counts` spell it."""
        return self.path.value

    @property
    def fused(self) -> bool:
        """The layers run as fused C calls (alone or as a team)."""
        return self.path.fused

    @property
    def team(self) -> bool:
        """The ranks of a decode team run the step together (every row on every member)."""
        return self.path.team


@dataclass(kw_only=True, frozen=True, slots=True)
class FusedLayers:
    """What this rank's fused decode layers take (cpllm/model/execution/fused_decode.py `FusedDecode.capability`)."""

    max_rows: int | None = None
    """Most rows a step runs fused (None: any number)."""
    needs_team: bool = False
    """Steps run fused only as a team: the KV cache is sharded over its ranks, or the weights are."""
    team: StepPath | None = None
    """PCP_TEAM or TP_TEAM where the ranks formed a decode team (cpllm/model/execution/decode_team.py); None: alone."""
    team_rows: int = 0
    """Most rows the team's shared buffers hold (0 without a team)."""

    def fits_rows(self, rows: int) -> bool:
        """A step of `rows` rows is not too big to run fused (`max_rows`)."""
        return self.max_rows is None or rows <= self.max_rows


@dataclass(kw_only=True, frozen=True, slots=True)
class GraphBuckets:
    """The decode steps captured as CUDA graphs on this rank (cpllm/model/execution/cuda_graphs.py)."""

    sizes: tuple[int, ...]
    """Batch sizes captured, ascending."""
    width: int
    """Context slots per row the graphs read: the longest local context a replay serves."""


@dataclass(kw_only=True, frozen=True, slots=True)
class RankCapabilities:
    """What this rank can run, fixed once its model, pools, team and graphs exist: computed once at start-up
    (cpllm/worker/rank_capabilities.py); `plan_step` reads nothing else about the rank. The defaults describe a
    rank of eager layers alone."""

    pcp_size: int = 1
    """PCP ranks of the replica."""
    pcp_rank: int = 0
    """This rank's place among them."""
    kv_shards: int = 1
    """Ranks holding one request's context: the DCP group under the replicated layout, PCP x DCP under the sharded
    one."""
    replicated: bool = False
    """The replicated KV layout: every PCP rank keeps a whole copy of every request's K/V."""
    kv_groups: int = 1
    """The model's KV groups (cpllm/kv_groups.py): each step is laid out once per group."""
    fused: FusedLayers | None = None
    """The fused decode layers (None: the model has none, or they do not fit this rank's pools or layout)."""
    compiled: bool = False
    """Decode steps run compiled (--compile-decode, cpllm/model/execution/decode_graph.py)."""
    graphs: GraphBuckets | None = None
    """The captured CUDA graphs (None: decode steps run eager; the reason was logged at start)."""
    mlp_split: bool = False
    """The dense MLPs can split a decode step's columns over PCP (cpllm/model/mlp_split.py)."""
    lm_head_split: bool = False
    """The LM head's vocabulary is split over the PCP ranks (each computes a share of the logits)."""
    states: bool = False
    """The model has layers keeping a recurrent state per request (cpllm/layers/cache_spec.py STATE), which every
    row of a request advances: single tokens are then never split over PCP (each PCP rank runs every one, so every
    rank keeps the same states; docs/context_parallel.md, "State scan")."""

    def __post_init__(self):
        if not 0 <= self.pcp_rank < self.pcp_size:
            raise ValueError(f"pcp_rank {self.pcp_rank} outside [0, pcp_size={self.pcp_size})")
        if self.kv_shards < 1 or self.kv_groups < 1:
            raise ValueError(f"kv_shards {self.kv_shards} and kv_groups {self.kv_groups} must be at least 1")

    @property
    def eager_decode(self) -> StepPath:
        """The eager layers' path for a step of single tokens on this layout."""
        return eager_decode_path(self.kv_shards, self.pcp_size, self.replicated)


def eager_decode_path(kv_shards: int, pcp_size: int, replicated: bool) -> StepPath:
    """The eager layers' path for a step of single tokens: `kv_shards` ranks hold one request's context (the
    DCP group under the replicated layout, PCP x DCP under the sharded one)."""
    if kv_shards == 1:
        return StepPath.ONE_SHARD
    if not replicated and kv_shards == pcp_size:  # no DCP: every PCP rank holds every query already
        return StepPath.PCP_DECODE
    return StepPath.GATHERED_DECODE


def plan_step(chunks, caps: RankCapabilities, strategy: str | None = None) -> StepPlan:
    """The plan of a step of `chunks` on a rank of `caps` (`strategy`: the step's prefill strategy, chosen by the
    runner alike on every rank). Every rank of a team, and every rank of a collective path, plans alike: they
    decide from the same step and the facts they share; only a rank running the fused layers alone may plan
    otherwise than its PCP peers (its rows are its own).

    A step with a chunk of several new tokens is a prefill. A step of single tokens runs the fused layers, as a team
    or alone, where they take it (faster than the compiled step: docs/benchmarks.md), else the compiled step, else
    the eager layers' path for this layout; then the CUDA graph bucket, the MLP split and the replicas' sync
    follow from that path."""
    # each PCP copy computes its own tokens, outside a team; never with states (every copy advances every state)
    split_layout = caps.replicated and caps.pcp_size > 1 and not caps.states
    if any(len(chunk.token_ids) > 1 for chunk in chunks):
        return StepPlan(path=StepPath.PREFILL, strategy=strategy, split_single_tokens=split_layout,
                        lm_head_split=caps.lm_head_split)
    path = _fused_path(chunks, caps) or (StepPath.COMPILED if caps.compiled else caps.eager_decode)
    split = split_layout and not path.team
    same_rows = caps.pcp_size > 1 and not split  # every PCP rank holds every row
    return StepPlan(path=path, strategy=strategy, split_single_tokens=split, replica_sync=split,
                    graph_bucket=_graph_bucket(chunks, path, split, caps),
                    mlp_split=caps.mlp_split and same_rows and path in _EAGER_DECODE,
                    lm_head_split=caps.lm_head_split)


def _fused_path(chunks, caps: RankCapabilities) -> StepPath | None:
    """The fused layers' path for a step of single tokens, or None where they do not take it. Decided from the
    step alone, so every member of a team decides alike: a team takes the steps its buffers hold and only the team
    does where the layout needs one; alone, every row must be a decode row (no padding)."""
    fused, tokens = caps.fused, len(chunks)
    if fused is None:
        return None
    if fused.team is not None:
        return fused.team if 0 < tokens <= fused.team_rows and fused.fits_rows(tokens) else None
    if fused.needs_team:
        return None
    rows_here, rows = single_token_rows(tokens, caps.pcp_size, caps.pcp_rank, caps.replicated,
                                        [chunk.request_id for chunk in chunks])
    return StepPath.FUSED if 0 < rows_here == rows and fused.fits_rows(rows) else None


def _graph_bucket(chunks, path: StepPath, split: bool, caps: RankCapabilities) -> int | None:
    """The CUDA graph a step replays: a one-shard step of one KV group whose rows are all this rank's and whose
    contexts fit the graphs' slot table."""
    graphs = caps.graphs
    if graphs is None or path is not StepPath.ONE_SHARD or split or caps.kv_groups != 1 or not chunks:
        return None
    if max(chunk.start_pos for chunk in chunks) + 1 > graphs.width:  # one shard: each row reads positions <= its own
        return None
    return bucket_for(graphs.sizes, len(chunks))


def bucket_for(sizes: tuple[int, ...], batch: int) -> int | None:
    """The smallest captured size >= batch (None: larger than every bucket)."""
    for size in sizes:
        if size >= batch:
            return size
    return None


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
