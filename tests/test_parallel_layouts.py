"""Every parallel layout against the single-rank engine: real processes on gloo, tiny random models.

One LLM per layout runs the whole workload (docs/architecture.md, "Correctness contract"): prompts of
lengths {1, 2*PCP-1, 13, 37} plus one sharing a 24-token prefix with the
37-token prompt, a 9-token step budget (prompts chunked over several steps,
decodes mixed with chunks), a KV pool of about 120 tokens per CP group
(preemption), then the same prompts again (prefix-cache hits). The PCP=2 layouts
also run a prompt longer than one rank's KV cache holds. Launches are cached per
module, so each layout starts once however many tests read its results.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from cpllm import LLM
from parallel_helpers import (
    LaunchCache,
    KV_HEADS,
    MODEL_SEED,
    MODELS,
    BLOCK_SIZE,
    MAX_MODEL_LEN,
    MAX_NUM_BATCHED_TOKENS,
    Layout,
    assert_same_greedy,
    generate_counted,
    greedy_params,
    kv_bytes_for_group_tokens,
    max_abs_diff,
    prompt_logprob_values,
    random_prompt,
    reference_prompts,
    sampled_logprobs,
    workload_prompts,
)
from reference import hf_greedy
from tiny_models import make_tiny_hf_model

GROUP_TOKENS = 120
"""Tokens the KV pool of each layout's CP group holds: small enough to force preemption."""
REFERENCE_MAX_TOKENS = 32
LONG_MAX_TOKENS = 16
LONG_PROMPT_LEN = 90
"""More than a single rank holds with the PCP=2 layouts' per-rank bytes (60 tokens), less than PCP=2 holds (120)."""
COMMON = dict(max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
              threads_per_rank=1, distributed_timeout=60)

PCP2_ALLGATHER = Layout(tp=1, pcp=2, dcp=1, interleave=1, strategy="allgather")
PCP2_RING = Layout(tp=1, pcp=2, dcp=1, interleave=4, strategy="ring", max_tokens=32, transport="gloo")
TP2_DCP2 = Layout(tp=2, pcp=1, dcp=2, interleave=1)
LAYOUTS = {  # layout -> model
    PCP2_ALLGATHER: "kv2",
    PCP2_RING: "kv2",
    Layout(tp=1, pcp=4, dcp=1, interleave=1, strategy="ring"): "kv2",
    Layout(tp=2, pcp=2, dcp=1, interleave=4, strategy="allgather"): "kv2",
    TP2_DCP2: "kv1",
    Layout(tp=4, pcp=1, dcp=2, interleave=4): "kv2",
    Layout(tp=2, pcp=2, dcp=2, interleave=1, strategy="ring"): "kv1",
    Layout(tp=2, pcp=2, dcp=2, interleave=4, strategy="allgather", max_tokens=32): "kv1",
    Layout(tp=2, pcp=1, dcp=1): "kv2",
    Layout(tp=4, pcp=1, dcp=1): "kv2",  # 2 KV heads over 4 ranks: replicated
}
LONG_PROMPT_LAYOUTS = (PCP2_ALLGATHER, PCP2_RING)


@dataclass
class LayoutRun:
    """What one layout's LLM produced."""

    first: dict
    """Prompt name -> output of pass 1 (logprobs and prompt logprobs)."""
    second: dict
    """Prompt name -> output of pass 2 (same prompts, no prompt logprobs)."""
    second_pass_prefix_hits: int
    """Prefix-cache hit tokens counted during pass 2."""
    preemptions: int
    kv_capacity_tokens: int
    kv_bytes_per_rank: int
    blocks_per_rank: int
    long: object | None
    """Output of the long prompt (PCP=2 layouts only)."""


def long_prompt() -> list[int]:
    return random_prompt(LONG_PROMPT_LEN, seed=LONG_PROMPT_LEN)


class Launches(LaunchCache):
    """Module-wide cache of model folders, reference runs and layout runs."""

    def reference(self, model: str) -> dict:
        """The single-rank engine on every prompt of the suite, same budget and block size, a roomy KV pool."""
        if model not in self._references:
            options = dict(COMMON, kv_cache_memory_bytes=64 * 2**10 * KV_HEADS[model])  # 1024 tokens
            with LLM(self.folder(model), **options) as llm:
                params = greedy_params(REFERENCE_MAX_TOKENS, prompt_logprobs=True)
                self._references[model] = generate_counted(llm, reference_prompts(), params, "ref")
        return self._references[model]

    def successful_runs(self) -> dict[Layout, LayoutRun]:
        """Every layout that ran to the end (launching the ones not run yet); failures are reported by their tests."""
        runs = {}
        for layout in LAYOUTS:
            try:
                runs[layout] = self.run(layout)
            except Exception:
                pass
        return runs

    def _launch(self, layout: Layout) -> LayoutRun:
        model = LAYOUTS[layout]
        kv_bytes, blocks = kv_bytes_for_group_tokens(GROUP_TOKENS, KV_HEADS[model], layout)
        prompts = workload_prompts(layout.pcp)
        with LLM(self.folder(model), kv_cache_memory_bytes=kv_bytes, **COMMON, **layout.engine_options()) as llm:
            scheduler = llm.engine.scheduler
            first = generate_counted(llm, prompts, greedy_params(layout.max_tokens, prompt_logprobs=True), "p1")
            hits_before = scheduler.num_prefix_hit_tokens
            second = generate_counted(llm, prompts, greedy_params(layout.max_tokens, prompt_logprobs=False), "p2")
            hits = scheduler.num_prefix_hit_tokens - hits_before
            long = None
            if layout in LONG_PROMPT_LAYOUTS:
                params = greedy_params(LONG_MAX_TOKENS, prompt_logprobs=True)
                long = generate_counted(llm, {"long": long_prompt()}, params, "long")["long"]
            return LayoutRun(first=first, second=second, second_pass_prefix_hits=hits,
                             preemptions=scheduler.num_preemptions, kv_capacity_tokens=llm.engine.kv_capacity_tokens,
                             kv_bytes_per_rank=kv_bytes, blocks_per_rank=blocks, long=long)


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> Launches:
    return Launches(tmp_path_factory)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", list(LAYOUTS), ids=Layout.label)
def test_layout_matches_single_rank(launches, layout):
    reference = launches.reference(LAYOUTS[layout])
    run = launches.run(layout)
    assert sorted(run.first) == sorted(workload_prompts(layout.pcp))
    for name, output in run.first.items():
        assert len(output.outputs[0].token_ids) == layout.max_tokens, name
        assert_same_greedy(output, reference[name], what=f"{layout.label()} pass 1 {name}", prompt_logprobs=True)
    for name, output in run.second.items():
        assert_same_greedy(output, reference[name], what=f"{layout.label()} pass 2 {name}", prompt_logprobs=False)
    assert run.second_pass_prefix_hits > 0, "pass 2 repeats pass 1's prompts and should hit the prefix cache"
    # The CP group holds blocks_per_rank virtual blocks of block_size x cp_size tokens.
    assert run.kv_capacity_tokens == run.blocks_per_rank * BLOCK_SIZE * layout.cp_size


@pytest.mark.timeout(300)
def test_small_kv_pool_preempts(launches):
    """The ~120-token pools are too small for the workload: requests get preempted and still match (above)."""
    preempted = {layout.label(): run.preemptions for layout, run in launches.successful_runs().items()}
    assert preempted and all(count > 0 for count in preempted.values()), preempted


def single_rank_capacity_and_rejection(folder: str, kv_bytes: int, prompt: list[int]) -> tuple[int, str]:
    """KV capacity of the single-rank engine with `kv_bytes`, and the error refusing `prompt`."""
    with LLM(folder, kv_cache_memory_bytes=kv_bytes, **COMMON) as llm:
        capacity = llm.engine.kv_capacity_tokens
        with pytest.raises(ValueError) as refused:
            llm.generate([{"prompt_token_ids": prompt}], greedy_params(LONG_MAX_TOKENS, prompt_logprobs=False))
    return capacity, str(refused.value)


@pytest.mark.timeout(300)
def test_kv_capacity_scales_with_cp_size(launches):
    """Same kv_cache_memory_bytes per rank: PCP=2 and DCP=2 hold twice the tokens of one rank."""
    pcp2, dcp2 = launches.run(PCP2_ALLGATHER), launches.run(TP2_DCP2)
    assert launches.run(PCP2_RING).kv_capacity_tokens == pcp2.kv_capacity_tokens

    single, message = single_rank_capacity_and_rejection(launches.folder("kv2"), pcp2.kv_bytes_per_rank,
                                                         long_prompt())
    assert pcp2.kv_capacity_tokens == 2 * single
    assert single < LONG_PROMPT_LEN + LONG_MAX_TOKENS <= pcp2.kv_capacity_tokens
    assert str(single) in message and str(LONG_PROMPT_LEN) in message, message

    # With one KV head, TP=2 replicates it, so a TP=2 rank stores as many bytes per token as a single rank.
    single_kv1, _ = single_rank_capacity_and_rejection(launches.folder("kv1"), dcp2.kv_bytes_per_rank,
                                                       long_prompt())
    assert dcp2.kv_capacity_tokens == 2 * single_kv1


@pytest.mark.timeout(300)
def test_prompt_longer_than_one_rank_holds(launches):
    """PCP=2 accepts it; ring and allgather agree with each other and with transformers on the same weights."""
    allgather, ring = launches.run(PCP2_ALLGATHER).long, launches.run(PCP2_RING).long
    tokens = allgather.outputs[0].token_ids
    assert len(tokens) == LONG_MAX_TOKENS
    assert ring.outputs[0].token_ids == tokens
    assert max_abs_diff(sampled_logprobs(ring), sampled_logprobs(allgather)) <= 1e-4
    assert max_abs_diff(prompt_logprob_values(ring), prompt_logprob_values(allgather)) <= 1e-4

    hf_tokens, hf_logprobs, hf_prompt_logprobs = hf_greedy(make_tiny_hf_model("llama", seed=MODEL_SEED, **MODELS["kv2"]),
                                                           long_prompt(), LONG_MAX_TOKENS)
    assert tokens == hf_tokens
    assert max_abs_diff(sampled_logprobs(allgather), hf_logprobs) <= 1e-4
    assert max_abs_diff(prompt_logprob_values(allgather), hf_prompt_logprobs) <= 1e-4
