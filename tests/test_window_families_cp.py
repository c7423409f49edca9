"""Every windowed family under TP=2 x PCP=2 x DCP=2 (both KV layouts) and TP=2 x DCP=2, against the single rank.

Families: Mistral, Qwen2, Gemma2, Gemma3, GPT-OSS, Mixtral, Qwen3 and Qwen3-MoE with an 8-token window and one KV
head (tests/tiny_window_models.py, tests/tiny_gpt_oss.py), so DCP=2 under TP=2 keeps one head per DCP group.
Two worlds of four real processes on gloo, each building its engines in turn (tests/engine_series.py):
- TP=2 x PCP=2 x DCP=2: every family, spread over the sharded and the replicated KV layout, interleave 1 and
  interleave = block size (4), and the prefill strategies (pass-q only sharded: the replicated layout refuses it);
  GPT-OSS (sinks) runs under both layouts, Gemma2 (soft-capped scores) under the replicated one (its sharded run
  is tests/test_window_layouts.py's);
- TP=2 x DCP=2: the families tests/test_window_layouts.py does not run there (GPT-OSS, Mixtral, Qwen3, Qwen3-MoE),
  at interleave 1 and 4.
Each engine runs the layout tests' workload (tests/parallel_helpers.py: prompts of 1, 3, 13 and 37 tokens, the
shared-prefix one of 31, a 9-token step budget, so chunked prefill runs beside decodes) twice, the second pass
hitting the prefix cache; greedy tokens must equal the single rank's and prompt and sampled-token logprobs agree
within LOGPROB_ATOL. Under PCP=2 the driver's counters must show the asked-for strategy ran every prompt step.
"""

from __future__ import annotations

from dataclasses import dataclass
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
MODEL_SEED = 4
KV_HEADS = 1
COMMON = dict(max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
              distributed_timeout=60)
THREADS = 1
PROMPTS = workload_prompts(2)


@dataclass(frozen=True, slots=True)
class Run:
    """One family's engine in a series: its parallel layout and KV layout."""

    family: str
    layout: Layout
    kv_layout: str = "sharded"

    def label(self) -> str:
        return f"{self.family}-{self.layout.label()}-{self.kv_layout}"

    def options(self) -> dict:
        return dict(**self.layout.engine_options(), cp_kv_cache_layout=self.kv_layout)


def _full(interleave: int, strategy: str) -> Layout:
    return Layout(tp=2, pcp=2, dcp=2, interleave=interleave, strategy=strategy, max_tokens=MAX_TOKENS)


def _tp_dcp(interleave: int) -> Layout:
    return Layout(tp=2, pcp=1, dcp=2, interleave=interleave, max_tokens=MAX_TOKENS)


SERIES = {  # world -> its engines, built in this order
    "tp2-pcp2-dcp2": (
        Run("mistral", _full(1, "pass-q")),
        Run("qwen2", _full(BLOCK_SIZE, "ring"), "replicated"),
        Run("gemma2", _full(BLOCK_SIZE, "allgather"), "replicated"),
        Run("gemma3", _full(1, "ring")),
        Run("gpt_oss", _full(BLOCK_SIZE, "pass-q")),
        Run("gpt_oss", _full(1, "ring"), "replicated"),
        Run("mixtral", _full(BLOCK_SIZE, "allgather")),
        Run("qwen3", _full(1, "allgather"), "replicated"),
        Run("qwen3_moe", _full(BLOCK_SIZE, "ring")),
    ),
    "tp2-dcp2": (
        Run("gpt_oss", _tp_dcp(1)),
        Run("mixtral", _tp_dcp(BLOCK_SIZE)),
        Run("qwen3", _tp_dcp(BLOCK_SIZE)),
        Run("qwen3_moe", _tp_dcp(1)),
    ),
}
RUNS = [(world, index) for world, runs in SERIES.items() for index in range(len(runs))]


class Worlds:
    """Module-wide: the families' folders, their single-rank references, each world's series (run once)."""

    def __init__(self, tmp_path_factory):
        self._tmp = tmp_path_factory
        self._folders: dict[str, str] = {}
        self._references: dict[str, dict] = {}
        self._results: dict[str, list] = {}

    def folder(self, family: str) -> str:
        if family not in self._folders:
            self._folders[family] = save_window_family(str(self._tmp.mktemp(family)), family, seed=MODEL_SEED,
                                                       num_key_value_heads=KV_HEADS)
        return self._folders[family]

    def reference(self, family: str) -> dict:
        if family not in self._references:
            with LLM(self.folder(family), **COMMON, threads_per_rank=THREADS) as llm:
                params = greedy_params(MAX_TOKENS, prompt_logprobs=True)
                self._references[family] = generate_counted(llm, PROMPTS, params, "ref")
        return self._references[family]

    def result(self, world: str, index: int):
        if world not in self._results:
            runs = SERIES[world]
            for run in runs:  # before the world starts: the single-rank engines run alone
                self.reference(run.family)
            configs = [build_engine_config(self.folder(r.family), **COMMON, **r.options()) for r in runs]
            body = partial(two_passes, prompts=PROMPTS, max_tokens=MAX_TOKENS)
            self._results[world] = run_series(configs, body, threads=THREADS)
        return self._results[world][index]


@pytest.fixture(scope="module")
def worlds(tmp_path_factory) -> Worlds:
    return Worlds(tmp_path_factory)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world_index", RUNS, ids=lambda wi: SERIES[wi[0]][wi[1]].label())
def test_family_layout_matches_single_rank(worlds, world_index):
    run = SERIES[world_index[0]][world_index[1]]
    what = run.label()
    result = worlds.result(*world_index)
    if isinstance(result, BaseException):
        raise AssertionError(f"{what}: the engine failed") from result
    reference = worlds.reference(run.family)
    assert_two_passes_match(result, reference, what, MAX_TOKENS)
    if run.layout.pcp > 1:
        counts, strategy = result["counts"], run.layout.strategy
        others = {s: counts[s] for s in COUNTED_STRATEGIES if s != strategy}
        assert counts[strategy] > 0 and not any(others.values()), f"{what}: strategy counts {counts}"
