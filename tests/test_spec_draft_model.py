"""Speculative decoding with a draft model (real processes on gloo): greedy is token for token the single-rank engine
without speculation, on one rank and under PCP=2 (sharded), TP=2 x DCP=2, TP=2 x PCP=2 x DCP=2 (replicated) and DP=2
(a draft per replica), with chunked prefill and prefix hits; the acceptance counters show the mix each draft is built
for; KV blocks and the prefix cache end as without speculation, the draft pool empty; a full draft pool and
preemption change nothing; seeded sampled runs repeat and sampled tokens keep their distribution; refusals name
their values.

The target is tests/spec_decode_helpers.py's successor-map Llama (one KV head, so DCP=2 under TP=2 holds). Drafts:
the target's own weights (nearly every draft accepted), the target's weights plus noise (a mix), and a random Qwen2
and a random Gemma 2 with windows of 8 (other families, the second with KV groups of its own: nearly every draft
rejected), all of the same vocabulary. Every launch runs the workload once.
"""

from __future__ import annotations

import json

import pytest
import torch

from cpllm import LLM, SamplingParams
from cpllm.engine.llm import build_engine_config
from cpllm.engine.sampler import Sampler, SamplingRow, make_generator, restricted_probs
from cpllm.engine_args import add_engine_arguments, engine_flags
from parallel_helpers import max_abs_diff, sampled_logprobs
from spec_decode_helpers import (SAMPLED_DRAWS, SAMPLED_TV_BOUND, check_blocks, random_tokens, run_phase,
                                 sampled_counts, save_cycle_model, walk)
from tiny_models import save_tiny_hf_model, tiny_hf_tokenizer
from tiny_window_models import save_tiny_window_model

K = 4
COMMON = dict(block_size=4, max_model_len=128, max_num_batched_tokens=16, kv_cache_memory_bytes=2**20,
              threads_per_rank=1, distributed_timeout=60)
"""A 16-token budget: the 37-token prompt takes three steps while the others decode beside it, and a step's budget
cuts some verify chunks' drafts (and the draft's catch-up of the long prompt takes several draft steps)."""
LAYOUTS = {
    "one": {},
    "pcp2": {"prefill_context_parallel_size": 2},
    "tp2-dcp2": {"tensor_parallel_size": 2, "decode_context_parallel_size": 2},
    "tp2-pcp2-dcp2-replicated": {"tensor_parallel_size": 2, "prefill_context_parallel_size": 2,
                                 "decode_context_parallel_size": 2, "cp_kv_cache_layout": "replicated"},
    "dp2": {"data_parallel_size": 2},
}
SMALL_POOL = 24 * 1024
"""24 blocks of 4 tokens (the tiny one-KV-head model's block is 1 KiB per rank): the workload preempts, and the
draft pool (as many tokens) is often short."""
NOISE = 0.4
"""Noise on the target's weights (times each tensor's std) for the "noisy" draft: about half its drafts accepted."""
MAX_TOKENS = 24
LOGPROB_ATOL = 1e-4


def greedy(**extra) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True, "logprobs": 1, **extra})


def workload(successor) -> list[dict[str, tuple[list[int], SamplingParams]]]:
    """Requests run together per phase; the second phase repeats the first's prompts (prefix hits) and adds one
    that shares the long prompt's first 24 tokens."""
    long = random_tokens(37, seed=37)
    first = {"copy10": (walk(successor, 7, 10), greedy()), "copy3": (walk(successor, 50, 3), greedy()),
             "random13": (random_tokens(13, seed=13), greedy()), "long37": (long, greedy()),
             "copy-short": (walk(successor, 120, 9), greedy(max_tokens=6))}
    second = {**first, "shared": (long[:24] + random_tokens(7, seed=99), greedy())}
    return [first, second]


def run_workload(llm: LLM, successor, check_step=None) -> dict:
    """request id ("<phase>-<name>") -> final output."""
    outputs = {}
    for number, phase in enumerate(workload(successor)):
        outputs.update(run_phase(llm.engine, number, phase, check_step))
    return outputs


def save_noisy_copy(source: str, folder: str, noise: float, seed: int) -> str:
    """The model in `source` with N(0, (noise * std)^2) added to every tensor."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(noise * param.std() * torch.randn(param.shape, generator=generator))
    model.save_pretrained(folder)
    tiny_hf_tokenizer().save_pretrained(folder)
    return folder


class Runs:
    """The model folders and one launch per (layout, draft), each on first use."""

    def __init__(self, tmp_path_factory):
        self.target, self.successor = save_cycle_model(str(tmp_path_factory.mktemp("target")),
                                                       num_key_value_heads=1)
        self.drafts = {
            "self": self.target,
            "noisy": save_noisy_copy(self.target, str(tmp_path_factory.mktemp("noisy")), NOISE, seed=2),
            "other": save_tiny_hf_model(str(tmp_path_factory.mktemp("other")), "qwen2", seed=3,
                                        num_key_value_heads=1),
            # a hybrid-window family (Gemma 2: windows of 8, soft-caps) whose KV groups differ from the target's
            "windowed": save_tiny_window_model(str(tmp_path_factory.mktemp("windowed")), "gemma2", seed=4),
        }
        self._runs: dict[tuple, dict] = {}

    def get(self, layout: str, draft: str | None, **extra) -> dict:
        key = (layout, draft, tuple(sorted(extra.items())))
        if key not in self._runs:
            self._runs[key] = self._launch(layout, draft, extra)
        return self._runs[key]

    def spec(self, draft: str) -> dict:
        return {"model": self.drafts[draft], "num_speculative_tokens": K, "draft_length": "fixed"}

    def _launch(self, layout: str, draft: str | None, extra: dict) -> dict:
        options = {**COMMON, **LAYOUTS[layout], **extra}
        if draft is not None:
            options["speculative_config"] = self.spec(draft)
        with LLM(self.target, **options) as llm:
            engine = llm.engine
            if layout == "dp2":  # the DP front: each replica's engine (its own draft) is in its own processes
                return dict(outputs=run_workload(llm, self.successor), scheduler=engine.scheduler_totals,
                            replica_totals=[r.report.totals for r in engine.replicas])
            outputs = run_workload(llm, self.successor, check_blocks if draft is not None else None)
            drafter = engine.spec.draft_model if draft is not None else None
            return dict(outputs=outputs, totals=engine.spec_decode_totals, scheduler=engine.scheduler_totals,
                        cached=engine.pool.cached_hashes, used=engine.pool.num_used,
                        draft_used=drafter.pool.num_used if drafter else None,
                        pool_short=drafter.num_pool_short if drafter else None,
                        seeded=self._seeded(llm) if layout == "one" and draft == "noisy" and not extra else None)

    def _seeded(self, llm: LLM) -> list[list[list[int]]]:
        """A seeded sampled request (n = 2) on a copy prompt, run twice."""
        params = SamplingParams(n=2, temperature=0.8, seed=5, max_tokens=16, ignore_eos=True)
        prompt = {"prompt_token_ids": walk(self.successor, 200, 10)}
        return [[c.token_ids for c in llm.generate(prompt, params)[0].outputs] for _ in range(2)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return Runs(tmp_path_factory)


def assert_same_outputs(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), what
    for name in want:
        tokens, expected = got[name].outputs[0].token_ids, want[name].outputs[0].token_ids
        assert tokens == expected, f"{what} {name}:\n{tokens}\n{expected}"
        assert got[name].outputs[0].finish_reason == want[name].outputs[0].finish_reason, (what, name)
        diff = max_abs_diff(sampled_logprobs(got[name]), sampled_logprobs(want[name]))
        assert diff <= LOGPROB_ATOL, f"{what} {name}: logprobs differ by {diff:.3g}"


def acceptance(totals) -> float:
    assert totals.num_draft_tokens > 40, totals
    return totals.num_accepted_tokens / totals.num_draft_tokens


# --- greedy: token for token ----------------------------------------------------------------------------------

@pytest.mark.parametrize("draft, low, high", [("self", 0.9, 1.0), ("noisy", 0.2, 0.85), ("other", 0.0, 0.15),
                                              ("windowed", 0.0, 0.15)])
def test_greedy_on_one_rank_is_token_identical_with_the_intended_acceptance(runs, draft, low, high):
    want, got = runs.get("one", None), runs.get("one", draft)
    assert_same_outputs(got["outputs"], want["outputs"], f"one rank, {draft} draft")
    rate = acceptance(got["totals"])
    assert low <= rate <= high, (draft, rate, got["totals"])
    assert got["scheduler"].spec_accepted_tokens == got["totals"].num_accepted_tokens
    assert want["scheduler"].prefix_hit_tokens > 0 and got["scheduler"].prefix_hit_tokens > 0  # the second phase


@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name not in ("one", "dp2")])
def test_greedy_under_context_parallel_layouts_is_the_single_rank_engine(runs, layout):
    """The noisy draft (accepted and rejected drafts both) against the single-rank engine without speculation."""
    want, got = runs.get("one", None), runs.get(layout, "noisy")
    assert_same_outputs(got["outputs"], want["outputs"], layout)
    assert 0.2 <= acceptance(got["totals"]) <= 0.85, got["totals"]
    assert got["draft_used"] == 0


def test_data_parallel_replicas_each_draft_and_match_the_single_rank(runs):
    """DP=2: each replica builds its own draft model on its driver rank; greedy is the single-rank engine's, both
    replicas verified drafts, and the front's counters are the replicas' sums."""
    want, got = runs.get("one", None), runs.get("dp2", "noisy")
    assert_same_outputs(got["outputs"], want["outputs"], "dp2")
    replicas = got["replica_totals"]
    assert len(replicas) == 2 and all(t.spec_drafts > 0 and t.spec_accepted_tokens > 0 for t in replicas), replicas
    for field in ("spec_drafts", "spec_draft_tokens", "spec_accepted_tokens"):
        assert getattr(got["scheduler"], field) == sum(getattr(t, field) for t in replicas), field


# --- KV accounting ----------------------------------------------------------------------------------------------

def test_pools_and_prefix_cache_end_as_without_speculation(runs):
    """The random draft: nearly every draft rejected, so most verify chunks roll back blocks."""
    want, got = runs.get("one", None), runs.get("one", "other")
    assert got["used"] == want["used"] == 0
    assert got["cached"] == want["cached"] and len(want["cached"]) > 10
    for draft in ("self", "noisy", "other", "windowed"):
        assert runs.get("one", draft)["draft_used"] == 0, draft


def test_full_draft_pool_and_preemption_change_nothing(runs):
    """A target pool of 96 tokens (the draft's as many): requests are preempted (their draft blocks go back) and
    some steps find the draft pool short (those requests decode without drafts)."""
    want = runs.get("one", None)["outputs"]
    got = runs.get("one", "self", kv_cache_memory_bytes=SMALL_POOL)
    assert_same_outputs(got["outputs"], want, "small pool")
    assert got["scheduler"].preemptions > 0 and got["pool_short"] > 0, (got["scheduler"], got["pool_short"])
    assert got["totals"].num_accepted_tokens > 0.9 * got["totals"].num_draft_tokens > 0
    assert got["draft_used"] == 0 and got["used"] == 0


# --- sampling ---------------------------------------------------------------------------------------------------

def test_seeded_sampling_repeats(runs):
    first, second = runs.get("one", "noisy")["seeded"]
    assert first == second and first[0] != first[1]


def test_sampled_tokens_keep_their_distribution(runs):
    """The first four sampled tokens of a copy prompt, jointly, with rejection sampling against the noisy draft's
    own distribution (q at the request's temperature and top-k) and without speculation (independent seeds).

    Any drafts verified as point masses would keep p too (the verify step conditions on the draft); what q buys is
    acceptance: min(1, p/q) keeps sum_t min(p_t, q_t) of the drafts, the point-mass test only sum_t p_t q_t. With
    these seeds the former keeps 0.58 of the drafts, the latter (q left out) 0.29: the lower bound 0.45 tells them
    apart."""
    prompt = walk(runs.successor, 7, 10)
    want, _ = sampled_counts(runs.target, prompt, None, seed=1)
    got, totals = sampled_counts(runs.target, prompt, runs.spec("noisy"), seed=2)
    assert 0.45 * totals.num_draft_tokens < totals.num_accepted_tokens < 0.9 * totals.num_draft_tokens, totals
    distance = 0.5 * sum(abs(got[k] - want[k]) for k in set(got) | set(want)) / SAMPLED_DRAWS
    assert distance < SAMPLED_TV_BOUND, (distance, got.most_common(8), want.most_common(8))


def test_sampler_against_a_drawn_draft_keeps_the_row_distribution():
    """Sampler.against_draft with q rows: a draft drawn from q is kept with min(1, p/q), else the residual is drawn,
    so the row's token has p, the distribution the sampler draws from (temperature and top-k applied); the draft is
    kept with probability sum min(p, q). 20000 draws over 5 outcomes: E[TV] ~ 0.006, bound 0.02."""
    logits = torch.randn(1, 12, generator=torch.Generator().manual_seed(4))
    params = SamplingParams(temperature=0.7, top_k=5)
    p = restricted_probs(logits[0].clone(), params).double()
    q = torch.softmax(torch.randn(12, generator=torch.Generator().manual_seed(5)), dim=-1).double()
    row = SamplingRow(params=params, prompt_token_ids=[1], output_token_ids=[], generator=make_generator(6))
    draws, sampler, counts, kept = make_generator(7), Sampler(), torch.zeros(12, dtype=torch.float64), 0
    for _ in range(20000):
        draft = int(torch.multinomial(q, 1, generator=draws))
        token, ok = sampler.against_draft(logits, row, None, draft, q.float())
        counts[token.token_id] += 1
        kept += ok
        assert ok == (token.token_id == draft)
    assert 0.5 * float((counts / counts.sum() - p).abs().sum()) < 0.02
    assert abs(kept / 20000 - float(torch.minimum(p, q).sum())) < 0.02
    assert counts[p == 0].sum() == 0


# --- configuration ----------------------------------------------------------------------------------------------

def test_draft_model_config_and_refusals_name_the_values(runs, tmp_path):
    target, draft = runs.target, runs.drafts["other"]
    for spec in ({"model": draft, "num_speculative_tokens": 3},
                 {"method": "draft_model", "model": draft, "num_speculative_tokens": 3,
                  "draft_tensor_parallel_size": 1}):
        config = build_engine_config(target, max_model_len=128, speculative_config=spec).speculative_config
        assert (config.method, config.model, config.num_speculative_tokens) == ("draft_model", draft, 3)
    wide = save_tiny_hf_model(str(tmp_path / "wide"), "llama", seed=0, vocab_size=320)
    short = save_tiny_hf_model(str(tmp_path / "short"), "llama", seed=0, max_position_embeddings=64)
    refusals = [
        ({"model": wide}, "has a vocabulary of 320 tokens; the target model's has 300"),
        ({"model": draft, "draft_tensor_parallel_size": 2}, "draft_tensor_parallel_size=2"),
        ({"model": short}, "has a context of 64 positions, shorter than max_model_len=128"),
        ({"model": draft, "method": "eagle"}, "method='eagle' is not built"),
        ({"model": draft, "method": "ngram"}, "method='ngram' with model="),
        ({"model": draft, "prompt_lookup_max": 3}, "['prompt_lookup_max'] apply to method 'ngram' only"),
    ]
    for change, message in refusals:
        with pytest.raises(ValueError) as error:
            build_engine_config(target, max_model_len=128,
                                speculative_config={"num_speculative_tokens": 3, **change})
        assert message in str(error.value), (change, str(error.value))


def test_flag_carries_a_draft_model():
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    spec = {"model": "path/to/draft", "num_speculative_tokens": 3}
    args = parser.parse_args(["--speculative-config", json.dumps(spec)])
    assert args.speculative_config == spec
    flags = engine_flags(args)
    assert json.loads(flags[flags.index("--speculative-config") + 1]) == spec
