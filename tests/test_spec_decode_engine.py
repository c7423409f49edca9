"""Speculative decoding through the engine (real processes on gloo): greedy with prompt lookup is token for token the
engine without it, on one rank, PCP=2 (both KV layouts), TP=2 x DCP=2 and TP=2, with chunked prefill, prefix hits,
stop tokens, max_tokens and a grammar; KV blocks and the prefix cache end as without speculation; seeded sampled
runs repeat and sampled tokens keep their distribution.

The model is tests/spec_decode_helpers.py's successor-map Llama (one KV head, so DCP=2 under TP=2 holds): prompts
that walk its cycles are copied by the model, so drafts are mostly accepted; random prompts with
prompt_lookup_min=1 get a draft at almost every step, mostly wrong. Every layout launches once and runs all the
phases; the reference is the single-rank engine without speculation on the same phases.
"""

from __future__ import annotations

import re

import pytest

from cpllm import LLM, SamplingParams
from cpllm.structured.params import StructuredOutputsParams
from parallel_helpers import max_abs_diff, sampled_logprobs
from spec_decode_helpers import (SAMPLED_DRAWS, SAMPLED_TV_BOUND, check_blocks, random_tokens, run_phase,
                                 sampled_counts, save_cycle_model, walk)
from tiny_models import save_tiny_hf_model

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1,
        "draft_length": "fixed"}
"""Fixed: every verify step carries all the drafts lookup finds, so rejected ones (and their rollback) stay many."""
COMMON = dict(block_size=4, max_model_len=128, max_num_batched_tokens=16, kv_cache_memory_bytes=2**20,
              threads_per_rank=1, distributed_timeout=60)
"""A 16-token budget: the 37-token prompt takes three steps while the others decode beside it, and a step's budget
cuts some verify chunks' drafts."""
LAYOUTS = {
    "one": {},
    "pcp2": {"prefill_context_parallel_size": 2},
    "tp2-dcp2": {"tensor_parallel_size": 2, "decode_context_parallel_size": 2},
    "tp2": {"tensor_parallel_size": 2},
    "pcp2-replicated": {"prefill_context_parallel_size": 2, "cp_kv_cache_layout": "replicated"},
}
"""A verify chunk runs as decode rows (ModelRunner._verify_rows) on every layout, in steps without a prompt chunk
(on one rank and TP=2 in every step): under PCP and DCP they attend to the sharded context on the decode plans."""
MAX_TOKENS = 24
STOP_TOKEN = 5
"""A token of the cycle the successor model's output for the copy prompt enters (its 8th output token)."""
LOGPROB_ATOL = 1e-4


def greedy(**extra) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True, "logprobs": 1, **extra})


def phases(successor) -> list[dict[str, tuple[list[int], SamplingParams]]]:
    """Requests run together per phase, the phases one after another (the last hits the prefix cache)."""
    copy = walk(successor, 7, 10)
    long = random_tokens(37, seed=37)
    return [
        {"copy10": (copy, greedy()), "copy3": (walk(successor, 50, 3), greedy()),
         "copy-stop": (copy, greedy(stop_token_ids=[STOP_TOKEN])),
         "copy-short": (walk(successor, 120, 9), greedy(max_tokens=6)),
         "grammar": (copy, greedy(structured_outputs=StructuredOutputsParams(regex="(ab|ba|cab)+"), max_tokens=16))},
        {"random13": (random_tokens(13, seed=13), greedy()), "long37": (long, greedy())},
        {"shared": (long[:24] + random_tokens(7, seed=99), greedy()), "copy-again": (copy, greedy())},
    ]


def run_phases(llm: LLM, successor, check_step=None) -> tuple[dict, list]:
    """name -> final output, and the spec-decode totals after each phase."""
    outputs, totals = {}, []
    for number, phase in enumerate(phases(successor)):
        done = run_phase(llm.engine, number, phase, check_step)
        outputs.update({request_id.split("-", 1)[1]: output for request_id, output in done.items()})
        totals.append(llm.engine.spec_decode_totals)
    return outputs, totals


class Runs:
    def __init__(self, tmp_path_factory):
        self.folder, self.successor = save_cycle_model(str(tmp_path_factory.mktemp("cycle")),
                                                       num_key_value_heads=1)
        self.random_folder = save_tiny_hf_model(str(tmp_path_factory.mktemp("random")), "llama", seed=1,
                                                num_key_value_heads=1)
        self._runs = {}

    def get(self, name: str):
        if name not in self._runs:
            self._runs[name] = self._launch(name)
        return self._runs[name]

    def _launch(self, name: str):
        folder = self.random_folder if name.startswith("random-") else self.folder
        name = name.removeprefix("random-")
        spec = name != "reference"
        options = {**COMMON, **LAYOUTS["one" if name in ("reference", "adaptive") else name]}
        if spec:
            options["speculative_config"] = {**SPEC, "draft_length": "adaptive" if name == "adaptive" else "fixed"}
        with LLM(folder, **options) as llm:
            outputs, totals = run_phases(llm, self.successor, check_blocks if spec else None)
            pool = llm.engine.pool
            return dict(outputs=outputs, totals=totals, cached=pool.cached_hashes, used=pool.num_used,
                        scheduler_totals=llm.engine.scheduler_totals,
                        plans=llm.engine.executor.rank_stats().plan_counts,
                        seeded=self._seeded(llm) if name == "one" and folder == self.folder else None)

    def _seeded(self, llm: LLM) -> list[list[list[int]]]:
        """A seeded sampled request (n = 2) on a copy prompt, run twice."""
        params = SamplingParams(n=2, temperature=0.8, seed=5, max_tokens=16, ignore_eos=True)
        prompt = {"prompt_token_ids": walk(self.successor, 200, 10)}
        return [[c.token_ids for c in llm.generate(prompt, params)[0].outputs] for _ in range(2)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return Runs(tmp_path_factory)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_greedy_with_prompt_lookup_is_token_identical(runs, layout):
    want, got = runs.get("reference")["outputs"], runs.get(layout)["outputs"]
    assert sorted(got) == sorted(want)
    for name in want:
        tokens, expected = got[name].outputs[0].token_ids, want[name].outputs[0].token_ids
        assert tokens == expected, f"{layout} {name}:\n{tokens}\n{expected}"
        assert got[name].outputs[0].finish_reason == want[name].outputs[0].finish_reason, name
        diff = max_abs_diff(sampled_logprobs(got[name]), sampled_logprobs(want[name]))
        assert diff <= LOGPROB_ATOL, f"{layout} {name}: logprobs differ by {diff:.3g}"
    if layout == "one":
        assert want["copy-stop"].outputs[0].finish_reason == "stop", "the tiny model's tokens changed: pick STOP_TOKEN"
        assert len(want["copy-stop"].outputs[0].token_ids) < MAX_TOKENS
        assert len(want["copy-short"].outputs[0].token_ids) == 6
        assert re.fullmatch("(ab|ba|cab)+", want["grammar"].outputs[0].text), want["grammar"].outputs[0].text


@pytest.mark.parametrize("model", ["cycle", "random"])
def test_greedy_identical_on_one_rank_with_many_rejections(runs, model):
    """The plain random model: drafts (prompt_lookup_min=1) at most steps, mostly wrong."""
    if model == "cycle":
        return  # the layouts' test covers it
    want, got = runs.get("random-reference")["outputs"], runs.get("random-one")["outputs"]
    for name in want:
        assert got[name].outputs[0].token_ids == want[name].outputs[0].token_ids, name
        assert max_abs_diff(sampled_logprobs(got[name]), sampled_logprobs(want[name])) <= LOGPROB_ATOL, name


def test_drafts_mostly_accepted_by_the_cycle_model_and_mostly_rejected_by_the_random_one(runs):
    cycle, random = runs.get("one")["totals"][-1], runs.get("random-one")["totals"][-1]
    assert cycle.num_draft_tokens > 50 and cycle.num_accepted_tokens > 0.6 * cycle.num_draft_tokens, cycle
    assert random.num_draft_tokens > 50 and random.num_accepted_tokens < 0.3 * random.num_draft_tokens, random
    assert runs.get("one")["scheduler_totals"].spec_accepted_tokens == cycle.num_accepted_tokens
    # one rank: verify chunks run as decode rows (runner._verify_rows): only steps with a prompt chunk take the
    # prefill plan (the reference's prompt steps), not the many verify steps
    plans, reference = runs.get("one")["plans"], runs.get("reference")["plans"]
    assert plans.get("prefill", 0) <= reference["prefill"] + 2 < cycle.num_drafts / 2, (plans, reference, cycle)


@pytest.mark.parametrize("model", ["", "random-"])
def test_adaptive_draft_length_keeps_the_tokens_and_drafts_less_where_drafts_fail(runs, model):
    """draft_length adaptive against fixed on one rank: the same tokens; on the random model (drafts mostly
    wrong) far fewer draft tokens scored, on the cycle model (drafts mostly right) most of them still."""
    want, got = runs.get(f"{model}reference")["outputs"], runs.get(f"{model}adaptive")["outputs"]
    for name in want:
        assert got[name].outputs[0].token_ids == want[name].outputs[0].token_ids, name
        assert max_abs_diff(sampled_logprobs(got[name]), sampled_logprobs(want[name])) <= LOGPROB_ATOL, name
    fixed, adaptive = runs.get(f"{model}one")["totals"][-1], runs.get(f"{model}adaptive")["totals"][-1]
    if model:
        assert adaptive.num_draft_tokens < 0.6 * fixed.num_draft_tokens, (adaptive, fixed)
    else:
        assert adaptive.num_draft_tokens > 0.6 * fixed.num_draft_tokens, (adaptive, fixed)
        assert adaptive.num_accepted_tokens > 0.6 * adaptive.num_draft_tokens, adaptive


@pytest.mark.parametrize("model", ["", "random-"])
def test_kv_pool_and_prefix_cache_end_as_without_speculation(runs, model):
    want, got = runs.get(f"{model}reference"), runs.get(f"{model}one")
    assert got["used"] == want["used"] == 0
    assert got["cached"] == want["cached"] and len(want["cached"]) > 10


def test_seeded_sampling_repeats(runs):
    first, second = runs.get("one")["seeded"]
    assert first == second and first[0] != first[1]


def test_sampled_tokens_keep_their_distribution(runs):
    """The first four sampled tokens of a copy prompt, jointly, with rejection sampling against prompt-lookup
    drafts and without speculation (independent seeds)."""
    prompt = walk(runs.successor, 7, 10)
    want, _ = sampled_counts(runs.folder, prompt, None, seed=1)
    got, totals = sampled_counts(runs.folder, prompt, SPEC, seed=2)
    assert 0.2 * totals.num_draft_tokens < totals.num_accepted_tokens < 0.9 * totals.num_draft_tokens, totals
    distance = 0.5 * sum(abs(got[k] - want[k]) for k in set(got) | set(want)) / SAMPLED_DRAWS
    assert distance < SAMPLED_TV_BOUND, (distance, got.most_common(8), want.most_common(8))
