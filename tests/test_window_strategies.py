"""Every prefill strategy on every windowed family under PCP=2, end to end, against the single-rank engine.

Families: Mistral, Qwen2, Gemma2, Gemma3, GPT-OSS, Mixtral, Qwen3 and Qwen3-MoE, each with an 8-token window
(tests/tiny_window_models.py, tests/tiny_gpt_oss.py); strategies: allgather, ring and pass-q. Each strategy is one
world of two real processes on gloo that builds every family's engine in turn (tests/engine_series.py), so the
24 pairs cost three launches. Each engine runs the layout tests' workload (tests/parallel_helpers.py: prompts of 1,
3, 13 and 37 tokens, 37 being over 4 windows, one sharing a 24-token prefix, a 9-token step budget, so chunked
prefill runs beside decodes) twice, the second pass hitting the prefix cache; greedy tokens must equal the single
rank's, prompt and sampled-token logprobs within LOGPROB_ATOL, and the driver's strategy counters must show the
strategy asked for, and only it, ran every prompt step.
"""

from __future__ import annotations

from functools import partial

import pytest

from cpllm import LLM
from cpllm.engine.llm import build_engine_config
from cpllm.planner.runtime import COUNTED_STRATEGIES
from engine_series import assert_two_passes_match, run_series, two_passes
from parallel_helpers import (
    BLOCK_SIZE,
    MAX_MODEL_LEN,
    MAX_NUM_BATCHED_TOKENS,
    Layout,
    generate_counted,
    greedy_params,
    workload_prompts,
)
from tiny_window_models import save_window_family

MAX_TOKENS = 12
MODEL_SEED = 3
FAMILIES = ("mistral", "qwen2", "gemma2", "gemma3", "gpt_oss", "mixtral", "qwen3", "qwen3_moe")
STRATEGIES = ("allgather", "ring", "pass-q")
COMMON = dict(max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
              distributed_timeout=60)
THREADS = 1
PROMPTS = workload_prompts(2)


class Series:
    """Module-wide: the families' folders, their single-rank references, one series per strategy (run once)."""

    def __init__(self, tmp_path_factory):
        self._tmp = tmp_path_factory
        self.folders = {f: save_window_family(str(tmp_path_factory.mktemp(f)), f, seed=MODEL_SEED) for f in FAMILIES}
        self.references: dict[str, dict] = {}
        self._runs: dict[str, dict] = {}

    def reference(self, family: str) -> dict:
        if family not in self.references:
            with LLM(self.folders[family], **COMMON, threads_per_rank=THREADS) as llm:
                params = greedy_params(MAX_TOKENS, prompt_logprobs=True)
                self.references[family] = generate_counted(llm, PROMPTS, params, "ref")
        return self.references[family]

    def run(self, strategy: str) -> dict:
        if strategy not in self._runs:
            for family in FAMILIES:  # before the world starts: the single-rank engines run alone
                self.reference(family)
            layout = Layout(tp=1, pcp=2, dcp=1, strategy=strategy)
            configs = [build_engine_config(self.folders[f], **COMMON, **layout.engine_options()) for f in FAMILIES]
            body = partial(two_passes, prompts=PROMPTS, max_tokens=MAX_TOKENS)
            self._runs[strategy] = dict(zip(FAMILIES, run_series(configs, body, threads=THREADS)))
        return self._runs[strategy]


@pytest.fixture(scope="module")
def series(tmp_path_factory) -> Series:
    return Series(tmp_path_factory)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("family", FAMILIES)
def test_strategy_matches_single_rank(series, family, strategy):
    result = series.run(strategy)[family]
    if isinstance(result, BaseException):
        raise result
    reference = series.reference(family)
    assert_two_passes_match(result, reference, f"{family} pcp2 {strategy}", MAX_TOKENS)
    counts = result["counts"]
    assert counts[strategy] > 0 and all(counts[s] == 0 for s in COUNTED_STRATEGIES if s != strategy), counts
