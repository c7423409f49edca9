"""The sliding-window families under context and tensor parallelism against their single-rank engine: real
processes on gloo, the tiny models of tests/tiny_window_models.py (window 8) with one KV head (so TP=2 x DCP=2
keeps one head per DCP group).

Each family runs TP=2 x DCP=2, Qwen2 and Gemma3 also PCP=2 with interleave 4, and Gemma2 (windows and soft-capped
scores) also TP=2 x PCP=2 x DCP=2. PCP=2 at interleave 1 with every strategy on every family is
tests/test_window_strategies.py. One LLM per layout runs the layout tests' workload
(tests/parallel_helpers.py: prompts of 1, 2*PCP-1, 13 and 37 tokens, 37 being over 4 windows, one sharing a
24-token prefix, a 9-token step budget) twice, the second time hitting the prefix cache.
"""

from __future__ import annotations

import pytest

from cpllm import LLM
from parallel_helpers import (
    BLOCK_SIZE,
    MAX_MODEL_LEN,
    MAX_NUM_BATCHED_TOKENS,
    LaunchCache,
    Layout,
    assert_same_greedy,
    generate_counted,
    greedy_params,
    workload_prompts,
)
from tiny_window_models import save_tiny_window_model

MAX_TOKENS = 16
MODEL_SEED = 2
COMMON = dict(max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
              threads_per_rank=1, distributed_timeout=60)
RUNS = [  # (family, layout)
    ("mistral", Layout(tp=2, pcp=1, dcp=2, max_tokens=MAX_TOKENS)),
    ("qwen2", Layout(tp=1, pcp=2, dcp=1, interleave=4, strategy="pass-q", max_tokens=MAX_TOKENS)),
    ("qwen2", Layout(tp=2, pcp=1, dcp=2, interleave=4, max_tokens=MAX_TOKENS)),
    ("gemma2", Layout(tp=2, pcp=1, dcp=2, max_tokens=MAX_TOKENS)),
    ("gemma2", Layout(tp=2, pcp=2, dcp=2, strategy="ring", max_tokens=MAX_TOKENS)),
    ("gemma3", Layout(tp=1, pcp=2, dcp=1, interleave=4, strategy="ring", max_tokens=MAX_TOKENS)),
    ("gemma3", Layout(tp=2, pcp=1, dcp=2, max_tokens=MAX_TOKENS)),
]


def reference_prompts() -> dict[str, list[int]]:
    """Every prompt the runs use (PCP 1 and 2)."""
    return {**workload_prompts(1), **workload_prompts(2)}


class Launches(LaunchCache):
    """Tiny window models, their single-rank references and one launch per (family, layout)."""

    def folder(self, family: str) -> str:
        if family not in self._folders:
            self._folders[family] = save_tiny_window_model(str(self._tmp.mktemp(family)), family, seed=MODEL_SEED,
                                                           num_key_value_heads=1)
        return self._folders[family]

    def reference(self, family: str) -> dict:
        if family not in self._references:
            with LLM(self.folder(family), **COMMON) as llm:
                params = greedy_params(MAX_TOKENS, prompt_logprobs=True)
                self._references[family] = generate_counted(llm, reference_prompts(), params, "ref")
        return self._references[family]

    def _launch(self, run) -> tuple[dict, dict, int]:
        family, layout = run
        prompts = workload_prompts(layout.pcp)
        with LLM(self.folder(family), **COMMON, **layout.engine_options()) as llm:
            first = generate_counted(llm, prompts, greedy_params(MAX_TOKENS, prompt_logprobs=True), "p1")
            hits = llm.engine.scheduler.num_prefix_hit_tokens
            second = generate_counted(llm, prompts, greedy_params(MAX_TOKENS, prompt_logprobs=False), "p2")
            return first, second, llm.engine.scheduler.num_prefix_hit_tokens - hits


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> Launches:
    return Launches(tmp_path_factory)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("run", RUNS, ids=lambda run: f"{run[0]}-{run[1].label()}")
def test_layout_matches_single_rank(launches, run):
    family, layout = run
    reference = launches.reference(family)
    first, second, second_pass_hits = launches.run(run)
    assert sorted(first) == sorted(workload_prompts(layout.pcp))
    what = f"{family} {layout.label()}"
    for name, output in first.items():
        assert len(output.outputs[0].token_ids) == MAX_TOKENS, name
        assert_same_greedy(output, reference[name], what=f"{what} pass 1 {name}", prompt_logprobs=True)
    for name, output in second.items():
        assert_same_greedy(output, reference[name], what=f"{what} pass 2 {name}", prompt_logprobs=False)
    assert second_pass_hits > 0, "pass 2 repeats pass 1's prompts and should hit the prefix cache"
