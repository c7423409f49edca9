"""Speculative decoding's verify steps on the layouts tests/test_spec_decode_engine.py does not launch (real
processes on gloo): greedy prompt lookup is token for token the single-rank engine without it under
TP=2 x PCP=2 x DCP=2 in both KV layouts (with chunked prefill and prefix hits) and under DP=2; there the verify steps
take the decode plan (every step without a prompt chunk runs a decode plan), DP=2's replicas each draft and their
counters add up to the single rank's; on one rank `n > 1` behaves as without speculation.

The model is tests/spec_decode_helpers.py's successor-map Llama (one KV head, so DCP=2 under TP=2 holds). Copy
prompts walk its cycles, so drafts are mostly accepted; decoy prompts hold each cycle token followed by a wrong one,
so every draft's first token is wrong. Every launch runs its phases once; the reference is the single-rank engine
without speculation on the same phases.
"""

from __future__ import annotations

import collections
import random

import pytest
from prometheus_client import CollectorRegistry

from cpllm import LLM, SamplingParams
from cpllm.context_parallel.kv_layout import KVLayout
from cpllm.context_parallel.metadata import build_step_batch
from cpllm.context_parallel.plan import single_token_rows
from cpllm.server.metrics_vllm import VllmMetrics
from cpllm.step import ScheduledChunk
from parallel_helpers import max_abs_diff, sampled_logprobs
from spec_decode_helpers import CYCLE, random_tokens, run_phase, save_cycle_model, walk
from step_plans import eager_plan

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1,
        "draft_length": "fixed"}
"""Fixed: every verify step carries all the drafts lookup finds, so rejected ones (and their rollback) stay many."""
COMMON = dict(block_size=4, max_model_len=128, max_num_batched_tokens=16, kv_cache_memory_bytes=2**20,
              threads_per_rank=1, distributed_timeout=60)
"""A 16-token budget: the 37-token prompt takes three steps beside verify chunks."""
LAYOUTS = {
    "tp2-pcp2-dcp2": {"tensor_parallel_size": 2, "prefill_context_parallel_size": 2,
                      "decode_context_parallel_size": 2, "cp_kv_cache_interleave_size": 4},
    "tp2-pcp2-dcp2-replicated": {"tensor_parallel_size": 2, "prefill_context_parallel_size": 2,
                                 "decode_context_parallel_size": 2, "cp_kv_cache_layout": "replicated"},
}
"""Both run decode steps on the eager gathered-decode plan (no fused layers with TP and PCP together). Sharded in
runs of 4 positions over the 4 KV shards: a verify chunk of the 3-token prompt starts where some shards hold none of
its first rows' context."""
LOGPROB_ATOL = 1e-4
ACCEPTED, REJECTED, REPEATED, DP = range(4)
"""The phases (`phases`), run one after another."""


def greedy(max_tokens: int = 24, **extra) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=1, **extra)


def decoy(successor, start: int, seed: int) -> list[int]:
    """Each token of the cycle from `start` followed by a token that is not its successor, then `start` again: the
    model walks the cycle, and the lookup's drafts (what followed the token in the prompt) start wrong."""
    rng = random.Random(seed)
    prompt = []
    for token in walk(successor, start, CYCLE):
        wrong = rng.choice([t for t in range(3, 300) if t != successor[token]])
        prompt += [token, wrong]
    return prompt + [start]


def phases(successor) -> list[dict[str, tuple[list[int], SamplingParams]]]:
    """Requests run together per phase. DP's requests: at most two verify chunks and a prompt's rest in a step, so
    the budget never cuts a draft and each request drafts the same wherever it runs."""
    copy, long = walk(successor, 7, 10), random_tokens(37, seed=37)
    return [
        {"copy10": (copy, greedy()), "copy3": (walk(successor, 50, 3), greedy()), "long37": (long, greedy())},
        {"decoy-a": (decoy(successor, 120, 1), greedy(8)), "decoy-b": (decoy(successor, 200, 2), greedy(8))},
        {"copy10-again": (copy, greedy()), "shared": (long[:24] + random_tokens(7, seed=99), greedy())},
        {"dp-copy10": (walk(successor, 30, 10), greedy(16)), "dp-copy9": (walk(successor, 90, 9), greedy(16)),
         "dp-decoy": (decoy(successor, 250, 3), greedy(8))},
    ]


def step_kind(step) -> str:
    """"prompt": a chunk of several new tokens that is not a whole verify chunk; else "verify" or "decode"."""
    whole = [c.num_draft_tokens and len(c.token_ids) == c.num_draft_tokens + 1 for c in step.chunks]
    if any(len(c.token_ids) > 1 and not w for c, w in zip(step.chunks, whole)):
        return "prompt"
    return "verify" if any(whole) else "decode"


def count_steps(llm: LLM) -> collections.Counter:
    """Step kinds the driver sends its ranks from now on (none without an executor here: DP's front)."""
    kinds = collections.Counter()
    executor = getattr(llm.engine, "executor", None)
    if executor is not None:
        execute = executor.execute

        def counted(step):
            if step.chunks:  # the runner counts no plan for an empty step
                kinds[step_kind(step)] += 1
            return execute(step)

        executor.execute = counted
    return kinds


def run_phases(llm: LLM, successor, numbers) -> tuple[dict, list]:
    """name -> final output, and the engine's scheduler totals after each phase."""
    outputs, totals = {}, []
    for number in numbers:
        done = run_phase(llm.engine, number, phases(successor)[number])
        outputs.update({request_id.split("-", 1)[1]: output for request_id, output in done.items()})
        totals.append(llm.engine.scheduler_totals)
    return outputs, totals


def several(llm: LLM, successor) -> dict:
    """n = 2 greedy, and n = 3 seeded sampled twice, on a copy prompt; with the draft tokens accepted meanwhile."""
    prompt = {"prompt_token_ids": walk(successor, 200, 10)}
    before = llm.engine.scheduler_totals.spec_accepted_tokens
    greedy_n = llm.generate(prompt, SamplingParams(n=2, temperature=0, max_tokens=16, ignore_eos=True))[0]
    seeded = SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=16, ignore_eos=True)
    return dict(greedy=[c.token_ids for c in greedy_n.outputs],
                seeded=[[c.token_ids for c in llm.generate(prompt, seeded)[0].outputs] for _ in range(2)],
                accepted=llm.engine.scheduler_totals.spec_accepted_tokens - before)


class Runs:
    """The cycle model and one launch per name, each on first use."""

    def __init__(self, tmp_path_factory):
        self.folder, self.successor = save_cycle_model(str(tmp_path_factory.mktemp("cycle")),
                                                       num_key_value_heads=1)
        self._runs = {}

    def get(self, name: str) -> dict:
        if name not in self._runs:
            self._runs[name] = self._launch(name)
        return self._runs[name]

    def _launch(self, name: str) -> dict:
        options = dict(COMMON, **LAYOUTS.get(name, {}))
        if name == "dp2":
            options["data_parallel_size"] = 2
        if name != "reference":
            options["speculative_config"] = SPEC
        numbers = {"reference": range(4), "one": range(4), "dp2": [DP]}.get(name, range(DP))
        with LLM(self.folder, **options) as llm:
            kinds = count_steps(llm)
            outputs, totals = run_phases(llm, self.successor, numbers)
            run = dict(outputs=outputs, totals=dict(zip(numbers, totals)), kinds=kinds)
            executor = getattr(llm.engine, "executor", None)
            run["plans"] = dict(executor.rank_stats().plan_counts) if executor is not None else None
            replicas = getattr(llm.engine, "replicas", None)
            run["replica_totals"] = [r.report.totals for r in replicas] if replicas else None
            if name in ("reference", "one"):
                run["several"] = several(llm, self.successor)
            return run


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return Runs(tmp_path_factory)


def assert_same_greedy(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want) and got, what
    for name in want:
        tokens, expected = got[name].outputs[0].token_ids, want[name].outputs[0].token_ids
        assert tokens == expected, f"{what} {name}:\n{tokens}\n{expected}"
        diff = max_abs_diff(sampled_logprobs(got[name]), sampled_logprobs(want[name]))
        assert diff <= LOGPROB_ATOL, f"{what} {name}: logprobs differ by {diff:.3g}"


def phase_outputs(run: dict, numbers, successor) -> dict:
    names = {name for number in numbers for name in phases(successor)[number]}
    return {name: output for name, output in run["outputs"].items() if name in names}


def spec_delta(run: dict, number: int) -> tuple[int, int, int]:
    """(verify chunks, draft tokens, accepted tokens) of one phase."""
    after, numbers = run["totals"][number], sorted(run["totals"])
    before = run["totals"][numbers[numbers.index(number) - 1]] if numbers.index(number) else None
    fields = ("spec_drafts", "spec_draft_tokens", "spec_accepted_tokens")
    return tuple(getattr(after, f) - (getattr(before, f) if before is not None else 0) for f in fields)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_greedy_with_prompt_lookup_is_token_identical(runs, layout):
    want = phase_outputs(runs.get("reference"), range(DP), runs.successor)
    assert_same_greedy(runs.get(layout)["outputs"], want, layout)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_drafts_mostly_accepted_on_copies_and_mostly_rejected_on_decoys(runs, layout):
    run = runs.get(layout)
    drafts, tokens, accepted = spec_delta(run, ACCEPTED)
    assert tokens > 20 and accepted > 0.6 * tokens, (drafts, tokens, accepted)
    drafts, tokens, accepted = spec_delta(run, REJECTED)
    assert tokens > 20 and accepted < 0.3 * tokens, (drafts, tokens, accepted)
    assert run["totals"][REPEATED].prefix_hit_tokens > run["totals"][REJECTED].prefix_hit_tokens  # prompts again


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_verify_steps_take_the_decode_plan(runs, layout):
    """Every step without a prompt chunk (verify steps among them) runs the layout's eager decode plan; only the
    steps with a prompt chunk run the prefill plan."""
    run = runs.get(layout)
    kinds, plans = run["kinds"], run["plans"]
    assert kinds["verify"] > 10, kinds
    assert plans == {"prefill": kinds["prompt"], "gathered-decode": kinds["verify"] + kinds["decode"]}, (plans, kinds)


def test_data_parallel_greedy_identical_and_counters_add_up(runs):
    dp, one = runs.get("dp2"), runs.get("one")
    assert_same_greedy(dp["outputs"], phase_outputs(runs.get("reference"), [DP], runs.successor), "dp2")
    # each replica drafted (the speculative config reached it); the front's totals are their sum, and equal the
    # single rank's on the same requests (no draft cut by the budget: each request drafts the same anywhere)
    assert len(dp["replica_totals"]) == 2 and all(t.spec_drafts > 0 for t in dp["replica_totals"]), dp
    summed = tuple(sum(getattr(t, f) for t in dp["replica_totals"])
                   for f in ("spec_drafts", "spec_draft_tokens", "spec_accepted_tokens"))
    assert spec_delta(dp, DP) == summed == spec_delta(one, DP), (summed, spec_delta(one, DP))
    assert summed[2] > 0
    # the server exports the front's totals (what /metrics reads under -dp)
    registry = CollectorRegistry()
    VllmMetrics(registry, "m").set_engine_state(0, 0, 0.0, dp["totals"][DP])
    exported = tuple(registry.get_sample_value(f"vllm:spec_decode_num_{name}_total", {"model_name": "m"})
                     for name in ("drafts", "draft_tokens", "accepted_tokens"))
    assert exported == summed, exported


def test_several_sequences_per_request_as_without_speculation(runs):
    one, reference = runs.get("one")["several"], runs.get("reference")["several"]
    assert one["greedy"][0] == one["greedy"][1] == reference["greedy"][0] == reference["greedy"][1]
    first, second = one["seeded"]
    assert first == second and len({tuple(t) for t in first}) > 1, first
    assert one["accepted"] > 10 and reference["accepted"] == 0, (one["accepted"], reference["accepted"])


def test_one_rank_greedy_identical_on_decoys_and_dp_requests(runs):
    assert_same_greedy(runs.get("one")["outputs"], runs.get("reference")["outputs"], "one rank")


def test_replicated_copies_keep_a_verify_chunks_rows_together():
    """Under the replicated layout outside a team each PCP copy computes the single tokens it is dealt and stores
    only their K/V until the step ends; a verify chunk's rows (one request, consecutive positions) must stay on
    one copy, and the runner's row counts (`single_token_rows`) must be the laid-out batch's."""
    layout = KVLayout(num_shards=1, shard_rank=0, interleave=1, block_size=4)
    ids = ["a", "a", "a", "b", "c", "c", "d"]
    chunks = [ScheduledChunk(request_id=r, token_ids=(1,), start_pos=8 + i, block_table=(1, 2, 3, 4), sample=True,
                             prompt_logits=False) for i, r in enumerate(ids)]
    homes = {}
    for rank in range(2):
        plan = eager_plan(chunks, layout, 2, replicated=True)
        batch = build_step_batch(chunks, layout, 2, rank, lambda c: [0], plan=plan)
        held = [i for i, r in enumerate(batch.attention.requests) if r.local_chunks]
        homes.update({i: rank for i in held})
        assert single_token_rows(len(ids), 2, rank, True, ids) == (len(held), batch.attention.num_rows)
    assert [homes[i] for i in range(len(ids))] == [0, 0, 0, 1, 1, 1, 0]
