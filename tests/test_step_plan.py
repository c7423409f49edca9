"""The execution plan of a step (cpllm/context_parallel/plan.py): a record made once per step by `plan_step` from
the step's chunks and the rank's capabilities, carried in the metadata, followed by every later stage; the
metadata's layout follows the plan."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from cpllm.context_parallel.kv_layout import KVLayout
from cpllm.context_parallel.metadata import build_step_batch
from cpllm.layers.gqa.shared_keys import shared_key_view
from cpllm.context_parallel.plan import (FusedLayers, GraphBuckets, RankCapabilities, StepPath, StepPlan,
                                         eager_decode_path, plan_step, single_token_rows)
from cpllm.model.execution.fused_decode import FusedDecode
from cpllm.step import ScheduledChunk
from step_plans import eager_plan

BLOCK = 4


def _chunks(requests, shared_prefix: bool = False):
    """requests: (context_len, num_new); with `shared_prefix`, every request's first blocks are the same."""
    chunks, next_block = [], 8
    for i, (ctx, new) in enumerate(requests):
        blocks = -(-(ctx + new) // BLOCK) + 1
        table = list(range(next_block, next_block + blocks))
        if shared_prefix:
            table[: ctx // BLOCK] = range(1, 1 + ctx // BLOCK)
        next_block += blocks
        chunks.append(ScheduledChunk(request_id=str(i), token_ids=tuple([1] * new), start_pos=ctx,
                                     block_table=tuple(table), sample=True, prompt_logits=False))
    return chunks


def _layout(cp_size: int = 1, cp_rank: int = 0) -> KVLayout:
    return KVLayout(num_shards=cp_size, shard_rank=cp_rank, interleave=1, block_size=BLOCK)


@pytest.mark.parametrize("kv_shards, pcp, replicated, want", [
    (1, 1, False, StepPath.ONE_SHARD),  # one rank, or TP alone
    (1, 2, True, StepPath.ONE_SHARD),  # replicated copies over PCP, no DCP
    (2, 2, False, StepPath.PCP_DECODE),  # sharded over PCP, no DCP
    (2, 1, False, StepPath.GATHERED_DECODE),  # DCP alone
    (4, 2, False, StepPath.GATHERED_DECODE),  # PCP x DCP
    (2, 2, True, StepPath.GATHERED_DECODE),  # replicated over PCP, DCP = 2
])
def test_eager_decode_plan_by_layout(kv_shards, pcp, replicated, want):
    assert eager_decode_path(kv_shards, pcp, replicated) is want
    caps = RankCapabilities(pcp_size=pcp, kv_shards=kv_shards, replicated=replicated)
    assert caps.eager_decode is want and plan_step(_chunks([(5, 1)]), caps).path is want


@pytest.mark.parametrize("tokens", [1, 2, 3, 5])
@pytest.mark.parametrize("pcp", [1, 2, 3])
def test_single_token_rows_match_the_layout(tokens, pcp):
    chunks = _chunks([(5, 1)] * tokens)
    for rank in range(pcp):
        batch = build_step_batch(chunks, _layout(), pcp, rank, lambda c: [0],
                                 plan=eager_plan(chunks, _layout(), pcp, replicated=True))
        rows_here = sum(1 for t in batch.token_ids.tolist() if t != 0)
        assert single_token_rows(tokens, pcp, rank, split=True) == (rows_here, batch.attention.num_rows)
    assert single_token_rows(tokens, pcp, 0, split=False) == (tokens, tokens)


def test_eager_plan_follows_the_layout():
    decodes, mixed = _chunks([(5, 1), (7, 1)]), _chunks([(5, 1), (0, 6)])
    for chunks, layout, pcp, want in [(decodes, _layout(), 1, StepPath.ONE_SHARD),
                                      (mixed, _layout(), 1, StepPath.PREFILL),
                                      (decodes, _layout(2, 1), 2, StepPath.PCP_DECODE),
                                      (decodes, _layout(2, 1), 1, StepPath.GATHERED_DECODE)]:
        plan = eager_plan(chunks, layout, pcp)
        assert plan.path is want
        assert build_step_batch(chunks, layout, pcp, pcp - 1, lambda c: [], plan=plan).attention.plan is plan


def test_a_decode_plan_refuses_a_prompt_chunk():
    with pytest.raises(ValueError, match="prompt chunk"):
        build_step_batch(_chunks([(0, 6)]), _layout(), 1, 0, lambda c: [], plan=StepPlan(path=StepPath.FUSED))


def test_build_step_batch_requires_the_plan_record():
    chunks = _chunks([(5, 1)])
    with pytest.raises(TypeError, match="required keyword-only argument: 'plan'"):
        build_step_batch(chunks, _layout(), 1, 0, lambda c: [])  # noqa: the missing plan is the point
    for wrong in (None, StepPath.ONE_SHARD, "one-shard"):
        with pytest.raises(TypeError, match="needs the step's StepPlan record"):
            build_step_batch(chunks, _layout(), 1, 0, lambda c: [], plan=wrong)


def test_fused_plans_lay_out_own_slots_and_teams_every_row():
    chunks = _chunks([(16, 1)] * 4, shared_prefix=True)
    eager = build_step_batch(chunks, _layout(), 1, 0, lambda c: [], plan=eager_plan(chunks, _layout()))
    assert shared_key_view(eager.attention.decode).shared_keys  # the union pays here (for the SDPA path)
    for path in (StepPath.FUSED, StepPath.PCP_TEAM, StepPath.TP_TEAM):
        plan = StepPlan(path=path)
        meta = build_step_batch(chunks, _layout(), 1, 0, lambda c: [], plan=plan).attention
        assert meta.plan is plan and not meta.decode.shared_keys and meta.decode.lengths is not None
    # Replicated over two PCP ranks: outside a team each copy computes half of the tokens, a team all of them.
    split = build_step_batch(chunks, _layout(), 2, 1, lambda c: [],
                             plan=eager_plan(chunks, _layout(), 2, replicated=True)).attention
    team = build_step_batch(chunks, _layout(), 2, 1, lambda c: [],
                            plan=eager_plan(chunks, _layout(), 2, replicated=True, path=StepPath.PCP_TEAM)).attention
    assert (split.num_rows, team.num_rows) == (2, 4) and team.decode.rows.tolist() == [[0, 1, 2, 3]] * 2


class _Team:
    def __init__(self, max_batch: int):
        self.max_batch = max_batch


def _fused_path(fused: FusedDecode, tokens: int, pcp: int = 1, rank: int = 0) -> StepPath | None:
    """The path `plan_step` gives a step of `tokens` single tokens on a rank of these fused layers (under the
    replicated layout over `pcp` PCP copies: each computes its share), None where it is not a fused one."""
    caps = RankCapabilities(pcp_size=pcp, pcp_rank=rank, replicated=pcp > 1, fused=fused.capability())
    path = plan_step(_chunks([(5, 1)] * tokens), caps).path
    return path if path.fused else None


@pytest.mark.parametrize("tensor_parallel", [False, True])
def test_fused_decode_plans_from_the_step_alone(tensor_parallel):
    alone = FusedDecode(None, [], [], team_size=1, needs_team=False)
    assert _fused_path(alone, 3) is StepPath.FUSED
    # padding rows (3 tokens over 2 copies: this one computes 1 of the batch's 2 rows), or no row here
    assert _fused_path(alone, 3, pcp=2, rank=1) is None and _fused_path(alone, 0) is None
    assert _fused_path(alone, 3, pcp=2, rank=0) is StepPath.FUSED  # 2 rows of 2 on this copy
    alone.max_rows = 2
    assert _fused_path(alone, 3) is None and _fused_path(alone, 2) is StepPath.FUSED
    member = FusedDecode(None, [], [], team_size=2, needs_team=True, tensor_parallel=tensor_parallel)
    assert _fused_path(member, 2) is None  # no team formed: a layout that needs one runs eager
    member.team = _Team(max_batch=4)
    assert _fused_path(member, 4) is (StepPath.TP_TEAM if tensor_parallel else StepPath.PCP_TEAM)
    assert _fused_path(member, 5) is None  # more rows than the team's buffers


_PROMPT, _DECODE = [(0, 6), (5, 1)], [(5, 1), (7, 1)]
_TEAM = FusedLayers(needs_team=True, team=StepPath.PCP_TEAM, team_rows=8)


@pytest.mark.parametrize("caps, step, want", [
    # one rank, eager layers: one-shard decode; the strategy reaches a prefill only as given
    (RankCapabilities(), _PROMPT, dict(path=StepPath.PREFILL, strategy="ring")),
    (RankCapabilities(), _DECODE, dict(path=StepPath.ONE_SHARD)),
    # fused layers alone before the compiled step; the compiled step before the eager path
    (RankCapabilities(fused=FusedLayers(), compiled=True), _DECODE, dict(path=StepPath.FUSED)),
    (RankCapabilities(fused=FusedLayers(max_rows=1), compiled=True), _DECODE, dict(path=StepPath.COMPILED)),
    # CUDA graphs: a one-shard step of one KV group replays the smallest bucket holding it, if its context fits
    (RankCapabilities(graphs=GraphBuckets(sizes=(1, 4), width=8)), _DECODE,
     dict(path=StepPath.ONE_SHARD, graph_bucket=4)),
    (RankCapabilities(graphs=GraphBuckets(sizes=(1, 4), width=7)), _DECODE, dict(path=StepPath.ONE_SHARD)),
    (RankCapabilities(graphs=GraphBuckets(sizes=(1,), width=8)), _DECODE, dict(path=StepPath.ONE_SHARD)),
    (RankCapabilities(graphs=GraphBuckets(sizes=(1, 4), width=8), kv_groups=2), _DECODE,
     dict(path=StepPath.ONE_SHARD)),
    (RankCapabilities(graphs=GraphBuckets(sizes=(1, 4), width=8)), _PROMPT,
     dict(path=StepPath.PREFILL, strategy="ring")),
    # sharded over PCP: the dense MLPs split decode steps (same rows on every rank), the LM head every step
    (RankCapabilities(pcp_size=2, kv_shards=2, mlp_split=True, lm_head_split=True), _DECODE,
     dict(path=StepPath.PCP_DECODE, mlp_split=True, lm_head_split=True)),
    (RankCapabilities(pcp_size=2, kv_shards=2, mlp_split=True, lm_head_split=True), _PROMPT,
     dict(path=StepPath.PREFILL, strategy="ring", lm_head_split=True)),
    (RankCapabilities(pcp_size=2, kv_shards=4, mlp_split=True), _DECODE,
     dict(path=StepPath.GATHERED_DECODE, mlp_split=True)),
    # a team runs every row on every member: no split tokens, no sync, no MLP split (the C layers split theirs)
    (RankCapabilities(pcp_size=2, kv_shards=2, mlp_split=True, fused=_TEAM), _DECODE,
     dict(path=StepPath.PCP_TEAM)),
    # replicated copies: each decode token on one copy, its K/V synced after the step; a prompt's travel anyway
    (RankCapabilities(pcp_size=2, replicated=True), _DECODE,
     dict(path=StepPath.ONE_SHARD, split_single_tokens=True, replica_sync=True)),
    (RankCapabilities(pcp_size=2, replicated=True), _PROMPT,
     dict(path=StepPath.PREFILL, strategy="ring", split_single_tokens=True)),
    (RankCapabilities(pcp_size=2, replicated=True, fused=_TEAM), _DECODE, dict(path=StepPath.PCP_TEAM)),
    (RankCapabilities(pcp_size=2, kv_shards=2, replicated=True), _DECODE,
     dict(path=StepPath.GATHERED_DECODE, split_single_tokens=True, replica_sync=True)),
    # a model with per-request states: every copy runs every token (each advances every state), nothing to sync
    (RankCapabilities(pcp_size=2, replicated=True, states=True), _DECODE, dict(path=StepPath.ONE_SHARD)),
    (RankCapabilities(pcp_size=2, replicated=True, states=True), _PROMPT,
     dict(path=StepPath.PREFILL, strategy="ring")),
])
def test_plan_step_from_capabilities_and_step(caps, step, want):
    """Each field of the plan from the rank's capabilities and the step's kind (prompt or single tokens); every
    field not named is the record's default (nothing beyond the path)."""
    strategy = "ring" if step is _PROMPT else None
    assert plan_step(_chunks(step), caps, strategy) == StepPlan(**want)


@torch.no_grad()
def test_the_dense_mlp_splits_exactly_when_the_plan_says(tmp_path):
    """A dense MLP with a decode split (cpllm/model/mlp_split.py; here a stand-in) runs it on a step planned
    `mlp_split` and its whole shard on any other step, the same metadata otherwise: the plan decides, the layer
    follows; the rank's capabilities read whether any MLP has a split."""
    from tiny_models import save_tiny_hf_model

    from cpllm.distributed.parallel_context import ParallelContext
    from cpllm.model.families.llama import LlamaForCausalLM
    from cpllm.model.loaders.loader import open_weights
    from cpllm.worker.rank_capabilities import rank_capabilities

    source = open_weights(save_tiny_hf_model(str(tmp_path / "tiny"), seed=4))
    model = LlamaForCausalLM(source.config, ParallelContext(), torch.float32, 128)
    model.load_weights(source)
    groups = types.SimpleNamespace(pcp_size=1, pcp_rank=0, dims=types.SimpleNamespace(kv_shard_size=1,
                                                                                      kv_replicated=False))
    assert not rank_capabilities(groups, model, kv_groups=1, compiled=False, decode_graphs=None).mlp_split
    split_rows = []

    class StandIn(torch.nn.Module):
        def forward(self, x):
            split_rows.append(x.shape[0])
            return torch.full_like(x, 7.0)

    mlp = model.layers[0].mlp
    mlp.decode_split = StandIn()
    assert rank_capabilities(groups, model, kv_groups=1, compiled=False, decode_graphs=None).mlp_split
    chunks = _chunks([(5, 1), (7, 1)])
    x = torch.randn(2, source.config.hidden_size, generator=torch.Generator().manual_seed(1))
    whole = mlp(x)  # no metadata: the whole shard
    outs = {}
    for mlp_split in (False, True):
        plan = StepPlan(path=StepPath.ONE_SHARD, mlp_split=mlp_split)
        outs[mlp_split] = mlp(x, build_step_batch(chunks, _layout(), 1, 0, lambda c: [], plan=plan).attention)
    assert torch.equal(outs[False], whole) and torch.equal(outs[True], torch.full_like(x, 7.0))
    assert split_rows == [2]


def test_capabilities_refuse_a_rank_outside_its_group():
    with pytest.raises(ValueError, match="pcp_rank 2 outside"):
        RankCapabilities(pcp_size=2, pcp_rank=2)
    with pytest.raises(ValueError, match="kv_shards 0"):
        RankCapabilities(kv_shards=0)


def test_step_plan_kinds():
    assert {p for p in StepPath if p.fused} == {StepPath.FUSED, StepPath.PCP_TEAM, StepPath.TP_TEAM}
    assert {p for p in StepPath if p.team} == {StepPath.PCP_TEAM, StepPath.TP_TEAM}
    assert StepPath("one-shard") is StepPath.ONE_SHARD
    plan = StepPlan(path=StepPath.PCP_TEAM)
    assert (plan.value, plan.fused, plan.team) == ("pcp-team", True, True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.path = StepPath.FUSED


def test_the_runner_counts_one_plan_per_step(tmp_path):
    """One rank: prompt steps plan "prefill", decode steps the fused layers' plan where they were built, else the
    one-shard eager path; every step is counted once, and the fused layers ran exactly the steps planned fused."""
    import tiny_models as tm  # tests/ is on sys.path under pytest
    from cpllm import LLM, SamplingParams

    folder = tm.save_tiny_hf_model(str(tmp_path / "tiny"), seed=5)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(folder, block_size=4, max_model_len=128, threads_per_rank=1) as llm:
        llm.generate([{"prompt_token_ids": [5 + i] * (3 + i)} for i in range(2)], params)
        executor = llm.engine.executor
        stats, fused = executor.rank_stats(), executor.rank_info.decode.fused
    counts = dict(stats.plan_counts)
    decode = StepPath.FUSED.value if fused else StepPath.ONE_SHARD.value
    assert set(counts) == {StepPath.PREFILL.value, decode} and counts[StepPath.PREFILL.value] >= 1
    assert counts[decode] >= params.max_tokens - 1
    assert stats.fused_steps == (counts[decode] if fused else 0)
