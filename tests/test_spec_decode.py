"""Speculative decoding's pieces without a model: the config and its refusals, the flags, prompt lookup, and the
rejection sampler against exact distributions.

The sampler checks draw a few thousand times from seeded generators and bound the total-variation distance between
the empirical and the exact distribution: with N draws over V outcomes its expectation is about
0.5 * sum_t sqrt(2 p_t (1 - p_t) / (pi N)) (0.006 for V = 6, N = 20000); the bound 0.02 is over three times that,
and the seeds are fixed, so the tests are deterministic.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest
import torch

from cpllm.config.speculative import MAX_SPECULATIVE_TOKENS, SpeculativeConfig, speculative_config
from cpllm.engine.draft_length import next_draft_limit
from cpllm.engine.ngram_drafter import NgramDrafter, longest_match
from cpllm.engine.rejection_sampler import rejection_sample
from cpllm.engine.sampler import Sampler, SamplingRow, make_generator, restricted_probs
from cpllm.engine.sampling_params import SamplingParams
from cpllm.engine_args import add_engine_arguments, engine_flags
from cpllm.engine_options import parse_json_object

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
TV_BOUND = 0.02
DRAWS = 20000


# --- config -----------------------------------------------------------------------------------------------------

def test_config_from_vllm_dict():
    config = speculative_config(NGRAM, vocab_size=300)
    assert config == SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=2,
                                       prompt_lookup_max=4)
    assert speculative_config(None, 300) is None
    one = speculative_config({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, 300)
    assert (one.prompt_lookup_min, one.prompt_lookup_max) == (3, 3)  # one bound given: the other takes its value
    default = speculative_config({"method": "ngram", "num_speculative_tokens": 2}, 300)
    assert (default.prompt_lookup_min, default.prompt_lookup_max) == (5, 5)
    assert default.draft_length == "adaptive"
    assert speculative_config({**NGRAM, "draft_length": "fixed"}, 300).draft_length == "fixed"
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.num_speculative_tokens = 3


@pytest.mark.parametrize("change, message", [
    ({"num_speculative_tokens": 0}, "num_speculative_tokens=0 must be an int in [1, 16]"),
    ({"num_speculative_tokens": MAX_SPECULATIVE_TOKENS + 1}, "num_speculative_tokens=17"),
    ({"num_speculative_tokens": 2.5}, "num_speculative_tokens=2.5"),
    ({"prompt_lookup_min": 5}, "prompt_lookup_min=5 must be <= prompt_lookup_max=4"),
    ({"prompt_lookup_max": 0}, "prompt_lookup_max=0 must be an int in [1, 32]"),
    ({"method": "eagle"}, "method='eagle' is not built"),
    ({"method": "mystery"}, "method='mystery' is not built"),
    ({"lookahead": 3}, "unknown keys ['lookahead']"),
    ({"draft_length": "dynamic"}, "draft_length='dynamic'; choose one of ('adaptive', 'fixed')"),
])
def test_config_refusals_name_the_values(change, message):
    with pytest.raises(ValueError) as error:
        speculative_config({**NGRAM, **change}, vocab_size=300)
    assert message in str(error.value)


def test_draft_model_refused_with_its_vocabulary():
    with pytest.raises(ValueError) as error:
        speculative_config({"model": "small", "num_speculative_tokens": 3}, 300, draft_vocab=lambda path: 512)
    assert "model='small' has a vocabulary of 512 tokens; the target model's has 300" in str(error.value)
    built = speculative_config({"model": "small", "num_speculative_tokens": 3}, 300, draft_vocab=lambda path: 300)
    assert (built.method, built.model, built.num_speculative_tokens) == ("draft_model", "small", 3)
    with pytest.raises(ValueError, match="needs num_speculative_tokens"):
        speculative_config({"method": "ngram"}, 300)
    with pytest.raises(ValueError, match="must be a dict"):
        speculative_config("ngram", 300)


def test_flag_parses_json_and_round_trips():
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--speculative-config", json.dumps(NGRAM)])
    assert args.speculative_config == NGRAM
    flags = engine_flags(args)
    assert json.loads(flags[flags.index("--speculative-config") + 1]) == NGRAM
    assert parser.parse_args([]).speculative_config is None
    with pytest.raises(argparse.ArgumentTypeError, match="not JSON"):
        parse_json_object("{method: ngram}")
    with pytest.raises(argparse.ArgumentTypeError, match="not a JSON object"):
        parse_json_object("[1, 2]")


def test_llm_config_refuses_before_start(tmp_path):
    from cpllm.engine.llm import build_engine_config
    from tiny_models import save_tiny_hf_model

    path = save_tiny_hf_model(str(tmp_path / "m"), "llama", seed=0)
    config = build_engine_config(path, speculative_config=NGRAM)
    assert config.speculative_config.num_speculative_tokens == 4
    other = save_tiny_hf_model(str(tmp_path / "d"), "llama", seed=0, vocab_size=320)
    with pytest.raises(ValueError, match="vocabulary of 320 tokens; the target model's has 300"):
        build_engine_config(path, speculative_config={"model": other, "num_speculative_tokens": 2})


# --- prompt lookup ----------------------------------------------------------------------------------------------

def drafter(k=3, lo=2, hi=4) -> NgramDrafter:
    return NgramDrafter(SpeculativeConfig(method="ngram", num_speculative_tokens=k, prompt_lookup_min=lo,
                                          prompt_lookup_max=hi))


def test_adaptive_draft_limit_cuts_after_a_rejection_and_doubles_back_to_k():
    k = 8
    assert next_draft_limit(8, 8, 8, k) == 8  # every draft kept: stays at k
    assert next_draft_limit(8, 8, 0, k) == 1  # the first draft rejected: one draft next
    assert next_draft_limit(8, 8, 5, k) == 6  # the accepted run plus one
    assert next_draft_limit(1, 1, 1, k) == 2 and next_draft_limit(4, 3, 3, k) == 8  # doubled, at most k
    assert next_draft_limit(3, 0, 0, k) == 3  # no drafts scored: unchanged
    limit, trail = k, []
    for accepted in (0, 1, 2, 4):  # a request whose drafts fail, then copy: 1, then 2, 4, 8 as each is kept
        limit = next_draft_limit(limit, min(limit, 8), accepted if accepted < limit else limit, k)
        trail.append(limit)
    assert trail == [1, 2, 4, 8]


def test_longest_match_first_then_most_recent():
    # suffix [2, 3, 4]: a 3-gram at 1 beats the more recent 2-gram [3, 4] at 6
    tokens = [1, 2, 3, 4, 5, 6, 3, 4, 7, 2, 3, 4]
    assert longest_match(tokens, 2, 4) == (1, 3)
    assert drafter().propose(tokens) == [5, 6, 3]
    # two 2-gram matches: the more recent one
    assert drafter().propose([1, 2, 3, 7, 2, 3, 8, 2, 3]) == [8, 2, 3]
    assert drafter(lo=3).propose([1, 2, 3, 7, 2, 3, 8, 2, 3]) == []  # no 3-gram matches
    assert drafter().propose([1, 2, 3, 4, 5]) == []
    assert drafter().propose([7]) == []


def test_drafts_limited_by_k_limit_and_the_end():
    tokens = [9, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2]
    assert drafter(k=4).propose(tokens) == [3, 4, 5, 6]
    assert drafter(k=4).propose(tokens, limit=2) == [3, 4]
    assert drafter(k=4).propose(tokens, limit=0) == []
    assert drafter(k=8).propose([5, 5, 5, 5]) == [5]  # the match [5, 5, 5] at 0 is followed by one token


def test_longest_match_agrees_with_brute_force():
    gen = torch.Generator().manual_seed(0)
    for _ in range(300):
        tokens = torch.randint(0, 3, (int(torch.randint(1, 30, (1,), generator=gen)),), generator=gen).tolist()
        assert longest_match(tokens, 2, 4) == brute_force_match(tokens, 2, 4), tokens


def brute_force_match(tokens, lo, hi):
    total = len(tokens)
    for n in range(min(hi, total - 1), lo - 1, -1):
        for start in range(total - n - 1, -1, -1):
            if tokens[start : start + n] == tokens[total - n :]:
                return start, n
    return None


# --- rejection sampling -----------------------------------------------------------------------------------------

def tv(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - probs).abs().sum())


P = torch.tensor([0.05, 0.4, 0.25, 0.1, 0.15, 0.05], dtype=torch.float64)


@pytest.mark.parametrize("draft", [1, 3, 5])
def test_point_mass_draft_keeps_the_target_distribution(draft):
    gen = make_generator(11 + draft)
    counts, accepted = torch.zeros(len(P), dtype=torch.float64), 0
    for _ in range(DRAWS):
        token, ok = rejection_sample(P, draft, gen)
        counts[token] += 1
        accepted += ok
        assert ok == (token == draft)
    assert tv(counts, P) < TV_BOUND
    assert abs(accepted / DRAWS - float(P[draft])) < TV_BOUND  # kept with probability p(d)


def test_drawn_draft_keeps_the_target_distribution():
    """A draft drawn from q (as a draft model's would be): accept with min(1, p/q), else the residual."""
    q = torch.tensor([0.3, 0.1, 0.1, 0.3, 0.1, 0.1], dtype=torch.float64)
    gen, draft_gen = make_generator(5), make_generator(6)
    counts, accepted = torch.zeros(len(P), dtype=torch.float64), 0
    for _ in range(DRAWS):
        draft = int(torch.multinomial(q, 1, generator=draft_gen))
        token, ok = rejection_sample(P, draft, gen, draft_probs=q)
        counts[token] += 1
        accepted += ok
    assert tv(counts, P) < TV_BOUND
    assert abs(accepted / DRAWS - float(torch.minimum(P, q).sum())) < TV_BOUND


def test_certain_draft_always_kept():
    probs = torch.tensor([0.0, 1.0, 0.0])
    gen = make_generator(0)
    assert all(rejection_sample(probs, 1, gen) == (1, True) for _ in range(50))
    assert all(rejection_sample(probs, 2, gen) == (1, False) for _ in range(50))


def row(params: SamplingParams, output=(), seed=3) -> SamplingRow:
    return SamplingRow(params=params, prompt_token_ids=[1, 2], output_token_ids=list(output),
                       generator=None if params.greedy else make_generator(seed))


def test_sampler_against_draft_matches_an_ordinary_draw():
    """The row's token has the distribution the sampler draws from (temperature, top-k, penalties applied)."""
    torch.manual_seed(0)
    logits = torch.randn(1, 12)
    params = SamplingParams(temperature=0.7, top_k=6, presence_penalty=0.5, max_tokens=4)
    sample_row = row(params, output=[3, 3])
    exact = restricted_probs(logits[0].clone() - 0.5 * (torch.arange(12) == 3), params).double()
    draft = int(exact.argsort()[-2])  # a likely token, not the likeliest
    counts = torch.zeros(12, dtype=torch.float64)
    sampler = Sampler()
    for _ in range(5000):
        token, ok = sampler.against_draft(logits, sample_row, None, draft)
        counts[token.token_id] += 1
        assert ok == (token.token_id == draft)
    assert tv(counts, exact) < 0.04  # 5000 draws over 6 outcomes: E[TV] ~ 0.013
    assert counts[exact == 0].sum() == 0  # nothing outside top-k


def test_greedy_against_draft_is_the_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0, 0.5]])
    sampler = Sampler()
    token, ok = sampler.against_draft(logits, row(SamplingParams(temperature=0, logprobs=1)), None, 1)
    assert (token.token_id, ok) == (1, True) and 1 in token.logprobs
    token, ok = sampler.against_draft(logits, row(SamplingParams(temperature=0)), None, 3)
    assert (token.token_id, ok) == (1, False)
    token, ok = sampler.against_draft(logits, row(SamplingParams(temperature=0)), None, None)
    assert (token.token_id, ok) == (1, False)


def test_seeded_rows_repeat():
    logits = torch.randn(1, 20, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=1.0, seed=7)
    runs = []
    for _ in range(2):
        sample_row, sampler = row(params, seed=7), Sampler()
        runs.append([sampler.against_draft(logits, sample_row, None, d)[0].token_id for d in range(20)])
    assert runs[0] == runs[1]


# --- metrics ----------------------------------------------------------------------------------------------------

def test_spec_decode_counters_under_vllm_names():
    from prometheus_client import CollectorRegistry

    from cpllm.engine.engine import SchedulerTotals
    from cpllm.server.metrics_vllm import VllmMetrics

    registry = CollectorRegistry()
    metrics = VllmMetrics(registry, "m")
    for drafts, tokens, accepted in ((2, 8, 5), (3, 12, 9)):  # running totals: counters take the increments
        metrics.set_engine_state(1, 0, 0.1, SchedulerTotals(spec_drafts=drafts, spec_draft_tokens=tokens,
                                                            spec_accepted_tokens=accepted))
    value = lambda name: registry.get_sample_value(name, {"model_name": "m"})  # noqa: E731
    assert value("vllm:spec_decode_num_drafts_total") == 3
    assert value("vllm:spec_decode_num_draft_tokens_total") == 12
    assert value("vllm:spec_decode_num_accepted_tokens_total") == 9
