"""`--cp-kv-cache-layout replicated` in the whole engine, against the single-rank engine (real gloo ranks).

Every PCP rank keeps a whole copy of the KV cache (divided over DCP only); without a decode team PCP ranks split
the decode batch and decode K/V computed on one PCP rank reach the others after the step. Each layout runs the workload of
tests/test_parallel_layouts.py (chunked prefill with decodes riding along, prompt logprobs, a small pool that
forces preemption, a second pass of prefix-cache hits) with PCP 2 and 3, TP and DCP, interleave 1 and 2, and the
allgather, ring and auto strategies; greedy tokens must equal the single-rank engine's and logprobs agree within
1e-4. The PCP=2 layout also decodes a batch of four: in those decode-only steps the attention layers talk to no
other rank, and either the ranks decode as one team (shared-memory barriers, each rank stores every row) or each
decodes its share and one all-gather per step keeps the copies equal; the outputs still match. The KV capacity is
blocks x block_size x DCP (a copy per PCP rank), half of the sharded layout's with PCP=2.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest

from cpllm.bench.comm_volume import count_collectives
from cpllm.context_parallel.kv_layout import KVLayout
from cpllm.context_parallel.metadata import build_step_batch
from cpllm.engine.llm import LLM, build_engine_config
from cpllm.launch import create_engine
from cpllm.model.tokenization.tokenizer import load_tokenizer
from cpllm.step import ScheduledChunk, output_positions
from parallel_helpers import (
    LaunchCache,
    KV_HEADS,
    BLOCK_SIZE,
    MAX_MODEL_LEN,
    MAX_NUM_BATCHED_TOKENS,
    Layout,
    assert_same_greedy,
    generate_counted,
    greedy_params,
    kv_bytes_per_block,
    reference_prompts,
    workload_prompts,
)
from step_plans import eager_plan

GROUP_TOKENS = 96
"""Tokens each PCP rank's copy holds: the workload (about 125 tokens with 8 generated each) must preempt."""
REFERENCE_MAX_TOKENS = 16
COMMON = dict(max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
              distributed_timeout=60)

PCP2 = Layout(tp=1, pcp=2, dcp=1, interleave=1, strategy="allgather", max_tokens=8)
LAYOUTS = {  # layout -> model
    PCP2: "kv2",
    Layout(tp=1, pcp=3, dcp=1, interleave=2, strategy="ring", max_tokens=8): "kv2",
    Layout(tp=2, pcp=2, dcp=2, interleave=2, strategy="auto", max_tokens=8): "kv1",
}
DECODE_BATCH = ("len13", "len37", "shared", "len3")
DECODE_STEPS = 4


class Engine:
    """An engine with the replicated layout (the config is built, then its layout replaced, so the test does not
    depend on LLM(...) forwarding the option)."""

    def __init__(self, folder: str, layout: Layout, **options):
        config = build_engine_config(folder, **options, **layout.engine_options())
        parallel = dataclasses.replace(config.parallel, cp_kv_cache_layout="replicated")
        self.engine = create_engine(dataclasses.replace(config, parallel=parallel), load_tokenizer(folder),
                                    threads_per_rank=1)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.engine.shutdown()


@dataclass
class Run:
    first: dict
    second: dict
    prefix_hits: int
    preemptions: int
    kv_capacity_tokens: int
    blocks_per_rank: int
    decode: dict | None = None
    """PCP=2 only: name -> output of the batch decoded together."""
    decode_calls: dict | None = None
    """PCP=2 only: collective calls by (module, op) during the decode-only steps."""
    team: bool = False
    """The PCP ranks formed a decode team (cpllm/model/execution/decode_team.py: fused layers, a core per rank)."""


def kv_bytes(model: str, layout: Layout) -> tuple[int, int]:
    """(bytes per rank, blocks per rank) so that each PCP rank's copy holds GROUP_TOKENS tokens."""
    blocks = GROUP_TOKENS // (BLOCK_SIZE * layout.dcp)
    return blocks * kv_bytes_per_block(KV_HEADS[model], layout.tp), blocks


class Launches(LaunchCache):
    def reference(self, model: str) -> dict:
        if model not in self._references:
            prompts = dict(reference_prompts(), **workload_prompts(3))
            with LLM(self.folder(model), threads_per_rank=1, kv_cache_memory_bytes=64 * 2**10 * KV_HEADS[model],
                     **COMMON) as llm:
                params = greedy_params(REFERENCE_MAX_TOKENS, prompt_logprobs=True)
                self._references[model] = generate_counted(llm, prompts, params, "ref")
        return self._references[model]

    def _launch(self, layout: Layout) -> Run:
        model = LAYOUTS[layout]
        budget, blocks = kv_bytes(model, layout)
        prompts = workload_prompts(layout.pcp)
        with Engine(self.folder(model), layout, kv_cache_memory_bytes=budget, **COMMON) as handle:
            engine = handle.engine
            first = generate_counted(handle, prompts, greedy_params(layout.max_tokens, prompt_logprobs=True), "p1")
            hits_before = engine.scheduler.num_prefix_hit_tokens
            second = generate_counted(handle, prompts, greedy_params(layout.max_tokens, prompt_logprobs=False), "p2")
            run = Run(first=first, second=second, prefix_hits=engine.scheduler.num_prefix_hit_tokens - hits_before,
                      preemptions=engine.scheduler.num_preemptions, kv_capacity_tokens=engine.kv_capacity_tokens,
                      blocks_per_rank=blocks)
            if layout == PCP2:
                run.decode, run.decode_calls = decode_batch(engine, {n: prompts[n] for n in DECODE_BATCH}, layout)
                run.team = engine.executor.rank_info.decode.team is not None
        return run


def decode_batch(engine, prompts: dict, layout: Layout) -> tuple[dict, dict]:
    """Prefill the prompts, then count collectives over DECODE_STEPS steps of decodes only, then finish."""
    params = greedy_params(layout.max_tokens, prompt_logprobs=False)
    for name, token_ids in prompts.items():
        engine.add_request(f"dec-{name}", token_ids, params)
    outputs = {}

    def step():
        for output in engine.step():
            if output.finished:
                outputs[output.request_id.removeprefix("dec-")] = output

    while engine.num_waiting or any(r.num_computed_tokens < len(r.prompt_token_ids)
                                    for r in engine.scheduler.running):
        step()
    with count_collectives() as counter:
        for _ in range(DECODE_STEPS):
            step()
    while engine.has_unfinished_requests():
        step()
    return outputs, {f"{module}.{op}": n for (module, op), n in counter.calls.items()}


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> Launches:
    return Launches(tmp_path_factory)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", list(LAYOUTS), ids=Layout.label)
def test_replicated_layout_matches_single_rank(launches, layout):
    reference = launches.reference(LAYOUTS[layout])
    run = launches.run(layout)
    for name, output in run.first.items():
        assert len(output.outputs[0].token_ids) == layout.max_tokens, name
        assert_same_greedy(output, reference[name], what=f"{layout.label()} pass 1 {name}", prompt_logprobs=True)
    for name, output in run.second.items():
        assert_same_greedy(output, reference[name], what=f"{layout.label()} pass 2 {name}", prompt_logprobs=False)
    assert run.prefix_hits > 0, "pass 2 repeats pass 1's prompts and should hit the prefix cache"
    # A copy per PCP rank: the replica holds what one PCP rank's DCP group holds.
    assert run.kv_capacity_tokens == run.blocks_per_rank * BLOCK_SIZE * layout.dcp


@pytest.mark.timeout(300)
def test_small_pool_preempts_under_the_replicated_layout(launches):
    assert launches.run(PCP2).preemptions > 0


@pytest.mark.timeout(300)
def test_decode_batch_needs_no_collective_in_the_layers(launches):
    reference = launches.reference(LAYOUTS[PCP2])
    run = launches.run(PCP2)
    for name in DECODE_BATCH:
        assert_same_greedy(run.decode[name], reference[name], what=f"decode batch {name}", prompt_logprobs=False)
    in_layers = {k: n for k, n in run.decode_calls.items() if k.startswith("cpllm.context_parallel.attention")}
    assert not in_layers, f"attention talked to other ranks in decode-only steps: {in_layers}"
    # A decode team's ranks each hold and store every row (they meet at shared-memory barriers, not collectives);
    # otherwise each rank decodes its share of the batch and one all-gather per step syncs the copies.
    synced = run.decode_calls.get("cpllm.context_parallel.replica_sync.all_gather", 0)
    assert synced == (0 if run.team else DECODE_STEPS), (run.team, run.decode_calls)


def test_decode_rows_are_split_over_pcp_ranks_and_synced_after_the_step():
    """Pure metadata: four decodes on PCP=2 go two to each rank; each rank knows which slots the other wrote."""
    chunks = [ScheduledChunk(request_id=str(i), token_ids=(5,), start_pos=10 + i, block_table=(1, 2, 3, 4, 5),
                             sample=True, prompt_logits=False) for i in range(4)]
    layout = KVLayout(num_shards=1, shard_rank=0, interleave=1, block_size=4)  # replicated, DCP = 1
    plan = eager_plan(chunks, layout, 2, replicated=True)
    batches = [build_step_batch(chunks, layout, 2, rank, output_positions, plan=plan) for rank in range(2)]
    assert [b.attention.num_rows for b in batches] == [2, 2]
    assert [len(b.attention.decode.requests) for b in batches] == [2, 2]
    homes = batches[0].output_rows
    assert sorted(p for p, _ in homes) == [0, 0, 1, 1]
    for rank, batch in enumerate(batches):
        assert batch.attention.write_rows.tolist() == [0, 1]  # its own two rows
        synced = {p: s.tolist() for p, s in enumerate(batch.replica_sync.slots)}
        expected = {p: sorted(layout.slot(c.start_pos, c.block_table) for c, (h, _) in zip(chunks, homes) if h == p)
                    for p in range(2)}
        assert {p: sorted(s) for p, s in synced.items()} == expected
