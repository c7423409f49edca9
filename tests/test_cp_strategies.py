"""The pass-Q and auto prefill strategies in the whole engine, against the single-rank engine (real gloo ranks).

Each layout runs the workload of tests/test_parallel_layouts.py: prompts of lengths {1, 2*PCP-1, 13, 37} plus one
sharing a 24-token prefix, a 9-token step budget (prompts chunked, decodes riding along), a 96-token KV pool per CP
group (the PCP=2 layout is preempted), then the same prompts again (prefix-cache hits); PCP 2 and 3, TP and DCP,
interleave 2 and 4. Greedy tokens must equal the single-rank engine's and logprobs (sampled and prompt) agree
within 1e-4.

`auto` is checked for its choices too: on a roomy step budget a fresh 90-token prompt runs the all-gather (on a
CPU host its K/V travel through shared memory and each PCP rank attends its runs in one call) and a 6-token chunk
on top of its 88 cached tokens runs pass-Q, both exact; in the chunked workload the first chunk of a prompt
(nothing cached) takes the all-gather and the later ones pass-Q.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from cpllm import LLM
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
    kv_bytes_for_group_tokens,
    random_prompt,
    reference_prompts,
    workload_prompts,
)

GROUP_TOKENS = 96
"""KV tokens per CP group: the workload (about 125 tokens with 8 generated each) must preempt."""
REFERENCE_MAX_TOKENS = 16
COMMON = dict(max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE, threads_per_rank=1, distributed_timeout=60)

AUTO = Layout(tp=1, pcp=2, dcp=1, interleave=4, strategy="auto", max_tokens=8)
PASS_Q_PCP2 = Layout(tp=1, pcp=2, dcp=1, interleave=2, strategy="pass-q", max_tokens=8)
LAYOUTS = {  # layout -> model
    PASS_Q_PCP2: "kv2",
    Layout(tp=1, pcp=3, dcp=1, interleave=4, strategy="pass-q", max_tokens=8): "kv2",
    Layout(tp=2, pcp=2, dcp=2, interleave=2, strategy="pass-q", max_tokens=8): "kv1",
    AUTO: "kv2",
}
LONG = 90
"""Fresh prompt of the auto check (P = 0: pass-Q would add its all-to-all, the ring a merge: the all-gather); it
becomes the long cached context of the follow-up."""
FOLLOW_UP_NEW = 6
ROOMY_BUDGET = 128
"""Step budget of the auto checks: the 90-token prompt runs in one step."""


def long_prompts() -> dict[str, list[int]]:
    """A fresh 90-token prompt, and one sharing its first 88 tokens (11 full virtual blocks of 8) plus 6 new."""
    long = random_prompt(LONG, seed=LONG)
    return {"long": long, "follow_up": long[:88] + random_prompt(FOLLOW_UP_NEW, seed=7)}


@dataclass
class Run:
    first: dict
    second: dict
    prefix_hits: int
    preemptions: int
    counts_first: dict
    """Prompt steps per strategy during pass 1."""
    auto: dict | None = None
    """The auto layout only: {"long": (output, counts), "follow_up": (output, counts)}."""


class Launches(LaunchCache):
    def reference(self, model: str) -> dict:
        if model not in self._references:
            options = dict(COMMON, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
                           kv_cache_memory_bytes=64 * 2**10 * KV_HEADS[model])
            prompts = dict(reference_prompts(), **workload_prompts(3), **long_prompts())  # PCP 3: a 5-token prompt
            with LLM(self.folder(model), **options) as llm:
                params = greedy_params(REFERENCE_MAX_TOKENS, prompt_logprobs=True)
                self._references[model] = generate_counted(llm, prompts, params, "ref")
        return self._references[model]

    def _launch(self, layout: Layout) -> Run:
        model = LAYOUTS[layout]
        kv_bytes, _ = kv_bytes_for_group_tokens(GROUP_TOKENS, KV_HEADS[model], layout)
        prompts = workload_prompts(layout.pcp)
        with LLM(self.folder(model), kv_cache_memory_bytes=kv_bytes, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
                 **COMMON, **layout.engine_options()) as llm:
            scheduler, executor = llm.engine.scheduler, llm.engine.executor
            first = generate_counted(llm, prompts, greedy_params(layout.max_tokens, prompt_logprobs=True), "p1")
            counts_first = executor.rank_stats().strategy_counts
            hits_before = scheduler.num_prefix_hit_tokens
            second = generate_counted(llm, prompts, greedy_params(layout.max_tokens, prompt_logprobs=False), "p2")
            run = Run(first=first, second=second, prefix_hits=scheduler.num_prefix_hit_tokens - hits_before,
                      preemptions=scheduler.num_preemptions, counts_first=counts_first)
        if layout.strategy == "auto":
            run.auto = self._auto_choices(layout, model)
        return run

    def _auto_choices(self, layout: Layout, model: str) -> dict:
        """The long prompt, then its follow-up, one at a time on a roomy budget, with the strategies each ran."""
        kv_bytes, _ = kv_bytes_for_group_tokens(4 * GROUP_TOKENS, KV_HEADS[model], layout)
        out = {}
        with LLM(self.folder(model), kv_cache_memory_bytes=kv_bytes, max_num_batched_tokens=ROOMY_BUDGET,
                 **COMMON, **layout.engine_options()) as llm:
            executor, scheduler = llm.engine.executor, llm.engine.scheduler
            for name, prompt in long_prompts().items():
                before, hits_before = executor.rank_stats().strategy_counts, scheduler.num_prefix_hit_tokens
                params = greedy_params(layout.max_tokens, prompt_logprobs=False)
                output = generate_counted(llm, {name: prompt}, params, name)[name]
                after = executor.rank_stats().strategy_counts
                out[name] = (output, {k: after[k] - before[k] for k in after},
                             scheduler.num_prefix_hit_tokens - hits_before)
        return out


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> Launches:
    return Launches(tmp_path_factory)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", list(LAYOUTS), ids=Layout.label)
def test_strategy_matches_single_rank(launches, layout):
    reference = launches.reference(LAYOUTS[layout])
    run = launches.run(layout)
    for name, output in run.first.items():
        assert len(output.outputs[0].token_ids) == layout.max_tokens, name
        assert_same_greedy(output, reference[name], what=f"{layout.label()} pass 1 {name}", prompt_logprobs=True)
    for name, output in run.second.items():
        assert_same_greedy(output, reference[name], what=f"{layout.label()} pass 2 {name}", prompt_logprobs=False)
    assert run.prefix_hits > 0, "pass 2 repeats pass 1's prompts and should hit the prefix cache"
    if layout.strategy == "pass-q":
        assert run.counts_first["pass-q"] > 0 and run.counts_first["ring"] == run.counts_first["allgather"] == 0
    else:  # auto, chunked: first chunks (nothing cached) all-gathered, continuations on pass-Q
        assert run.counts_first["allgather"] > 0 and run.counts_first["pass-q"] > 0, run.counts_first


@pytest.mark.timeout(300)
def test_small_pool_preempts_under_pass_q(launches):
    """The PCP=2 pass-Q layout's 96-token pool cannot hold the workload: requests are preempted (and match, above)."""
    assert launches.run(PASS_Q_PCP2).preemptions > 0


@pytest.mark.timeout(300)
def test_auto_picks_the_all_gather_for_a_fresh_prompt_and_pass_q_for_a_short_chunk_on_a_long_context(launches):
    reference = launches.reference(LAYOUTS[AUTO])
    choices = launches.run(AUTO).auto
    long_output, long_counts, _ = choices["long"]
    assert long_counts == {"allgather": 1, "ring": 0, "pass-q": 0}, long_counts
    assert_same_greedy(long_output, reference["long"], what="auto fresh 90-token prompt", prompt_logprobs=False)
    follow_output, follow_counts, hits = choices["follow_up"]
    assert hits == 88, f"the follow-up should reuse 88 cached tokens, reused {hits}"
    assert follow_counts == {"allgather": 0, "ring": 0, "pass-q": 1}, follow_counts
    assert_same_greedy(follow_output, reference["follow_up"], what="auto 6-token chunk on 88 cached tokens",
                       prompt_logprobs=False)
