"""The execution plan of a step (cpllm/context_parallel/plan.py): chosen once by the runner, carried in the
metadata, followed by every later stage; the metadata's layout follows the plan."""

from __future__ import annotations

import pytest

from cpllm.context_parallel.kv_layout import KVLayout
from cpllm.context_parallel.metadata import build_step_batch, shared_key_view
from cpllm.context_parallel.plan import StepPlan, eager_decode_plan, single_token_rows
from cpllm.model.fused_decode import FusedDecode
from cpllm.step import ScheduledChunk

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
    return KVLayout(cp_size=cp_size, cp_rank=cp_rank, interleave=1, block_size=BLOCK)


@pytest.mark.parametrize("kv_shards, pcp, replicated, want", [
    (1, 1, False, StepPlan.ONE_SHARD),  # one rank, or TP alone
    (1, 2, True, StepPlan.ONE_SHARD),  # replicated copies over PCP, no DCP
    (2, 2, False, StepPlan.PCP_DECODE),  # sharded over PCP, no DCP
    (2, 1, False, StepPlan.GATHERED_DECODE),  # DCP alone
    (4, 2, False, StepPlan.GATHERED_DECODE),  # PCP x DCP
    (2, 2, True, StepPlan.GATHERED_DECODE),  # replicated over PCP, DCP = 2
])
def test_eager_decode_plan_by_layout(kv_shards, pcp, replicated, want):
    assert eager_decode_plan(kv_shards, pcp, replicated) is want


@pytest.mark.parametrize("tokens", [1, 2, 3, 5])
@pytest.mark.parametrize("pcp", [1, 2, 3])
def test_single_token_rows_match_the_layout(tokens, pcp):
    chunks = _chunks([(5, 1)] * tokens)
    for rank in range(pcp):
        batch = build_step_batch(chunks, _layout(), pcp, rank, lambda c: [0], split_single_tokens=True)
        rows_here = sum(1 for t in batch.token_ids.tolist() if t != 0)
        assert single_token_rows(tokens, pcp, rank, split=True) == (rows_here, batch.attention.num_rows)
    assert single_token_rows(tokens, pcp, 0, split=False) == (tokens, tokens)


def test_default_plan_follows_the_layout():
    decodes, mixed = _chunks([(5, 1), (7, 1)]), _chunks([(5, 1), (0, 6)])
    assert build_step_batch(decodes, _layout(), 1, 0, lambda c: []).attention.plan is StepPlan.ONE_SHARD
    assert build_step_batch(mixed, _layout(), 1, 0, lambda c: []).attention.plan is StepPlan.PREFILL
    assert build_step_batch(decodes, _layout(2, 1), 2, 1, lambda c: []).attention.plan is StepPlan.PCP_DECODE
    assert build_step_batch(decodes, _layout(2, 1), 1, 0, lambda c: []).attention.plan is StepPlan.GATHERED_DECODE


def test_a_decode_plan_refuses_a_prompt_chunk():
    with pytest.raises(ValueError, match="prompt chunk"):
        build_step_batch(_chunks([(0, 6)]), _layout(), 1, 0, lambda c: [], plan=StepPlan.FUSED)


def test_fused_plans_lay_out_own_slots_and_teams_every_row():
    chunks = _chunks([(16, 1)] * 4, shared_prefix=True)
    eager = build_step_batch(chunks, _layout(), 1, 0, lambda c: [])
    assert shared_key_view(eager.attention.decode).shared_keys  # the union pays here (for the SDPA path)
    for plan in (StepPlan.FUSED, StepPlan.PCP_TEAM, StepPlan.TP_TEAM):
        meta = build_step_batch(chunks, _layout(), 1, 0, lambda c: [], plan=plan).attention
        assert meta.plan is plan and not meta.decode.shared_keys and meta.decode.lengths is not None
    # Replicated over two PCP ranks: outside a team each copy computes half of the tokens, a team all of them.
    split = build_step_batch(chunks, _layout(), 2, 1, lambda c: [], split_single_tokens=True).attention
    team = build_step_batch(chunks, _layout(), 2, 1, lambda c: [], split_single_tokens=True,
                            plan=StepPlan.PCP_TEAM).attention
    assert (split.num_rows, team.num_rows) == (2, 4) and team.decode.rows.tolist() == [[0, 1, 2, 3]] * 2


class _Team:
    def __init__(self, max_batch: int):
        self.max_batch = max_batch

    def takes(self, rows: int) -> bool:
        return 0 < rows <= self.max_batch


@pytest.mark.parametrize("tensor_parallel", [False, True])
def test_fused_decode_plans_from_the_step_alone(tensor_parallel):
    alone = FusedDecode(None, [], [], team_size=1, needs_team=False)
    assert alone.plan(3, 3, 3) is StepPlan.FUSED
    assert alone.plan(3, 1, 2) is None and alone.plan(0, 0, 0) is None  # padding rows, or no row here
    alone.max_rows = 2
    assert alone.plan(3, 3, 3) is None and alone.plan(2, 2, 2) is StepPlan.FUSED
    member = FusedDecode(None, [], [], team_size=2, needs_team=True, tensor_parallel=tensor_parallel)
    assert member.plan(2, 2, 2) is None  # no team formed: a layout that needs one runs eager
    member.team = _Team(max_batch=4)
    assert member.plan(4, 2, 2) is (StepPlan.TP_TEAM if tensor_parallel else StepPlan.PCP_TEAM)
    assert member.plan(5, 3, 3) is None  # more rows than the team's buffers


def test_step_plan_kinds():
    assert {p for p in StepPlan if p.fused} == {StepPlan.FUSED, StepPlan.PCP_TEAM, StepPlan.TP_TEAM}
    assert {p for p in StepPlan if p.team} == {StepPlan.PCP_TEAM, StepPlan.TP_TEAM}
    assert StepPlan("one-shard") is StepPlan.ONE_SHARD


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
    decode = StepPlan.FUSED.value if fused else StepPlan.ONE_SHARD.value
    assert set(counts) == {StepPlan.PREFILL.value, decode} and counts[StepPlan.PREFILL.value] >= 1
    assert counts[decode] >= params.max_tokens - 1
    assert stats.fused_steps == (counts[decode] if fused else 0)
