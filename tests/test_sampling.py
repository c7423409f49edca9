"""SamplingParams validation and the driver-side Sampler against hand-computed references."""

from __future__ import annotations

import math

import pytest
import torch

from cpllm.engine.sampler import (
    Sampler,
    SamplingRow,
    apply_penalties,
    make_generator,
    prompt_logprobs,
    restricted_probs,
)
from cpllm.engine.sampling_params import SamplingParams

# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", 0),
        ("n", True),
        ("max_tokens", 0),
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("top_k", 2.5),
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.1),
        ("repetition_penalty", 0.0),
        ("logprobs", -1),
        ("logprobs", 21),
        ("prompt_logprobs", 21),
        ("min_tokens", -1),
        ("seed", 1.5),
    ],
)
def test_invalid_value_names_field_and_value(field, value):
    with pytest.raises(ValueError) as err:
        SamplingParams(**{field: value})
    assert field in str(err.value)
    assert repr(value) in str(err.value)


def test_min_tokens_above_max_tokens_is_refused():
    with pytest.raises(ValueError, match=r"min_tokens=5 must be <= max_tokens=4"):
        SamplingParams(min_tokens=5, max_tokens=4)
    assert SamplingParams(min_tokens=100, max_tokens=None).min_tokens == 100


@pytest.mark.parametrize("stop", ["", ["ok", ""], [3]])
def test_bad_stop_strings_are_refused(stop):
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=stop)


def test_normalisation_and_properties():
    p = SamplingParams(stop="###")
    assert p.stop == ["###"] and p.stop_token_ids == []
    assert SamplingParams(stop=None).stop == []
    assert SamplingParams(stop=["a", "b"]).stop == ["a", "b"]
    assert SamplingParams(top_k=-1).top_k_or_none is None
    assert SamplingParams(top_k=0).top_k_or_none is None
    assert SamplingParams(top_k=7).top_k_or_none == 7
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=0.5).greedy
    assert not SamplingParams().has_penalties
    assert SamplingParams(repetition_penalty=1.1).has_penalties
    with pytest.raises(TypeError):
        SamplingParams(3)  # keyword-only


# ---------------------------------------------------------------- helpers

GREEDY = SamplingParams(temperature=0.0)


def row(params, prompt=(), output=(), generator=None, eos=()):
    return SamplingRow(
        params=params,
        prompt_token_ids=list(prompt),
        output_token_ids=list(output),
        generator=generator,
        eos_token_ids=tuple(eos),
    )


# ---------------------------------------------------------------- greedy and penalties


def test_greedy_is_argmax_in_a_mixed_batch():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    rows = [row(GREEDY) for _ in range(6)]
    rows[2] = row(SamplingParams(temperature=0.8), generator=make_generator(1))
    rows[4] = row(SamplingParams(seed=3), generator=make_generator(3))
    out = Sampler()(logits, rows)
    expected = logits.argmax(dim=-1).tolist()
    for i in (0, 1, 3, 5):
        assert out[i].token_id == expected[i]
        assert out[i].logprobs is None


def test_penalties_follow_the_formulas():
    logits = torch.tensor([2.0, -1.0, 0.5, -3.0, 1.0, 0.0])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    prompt, output = [0, 3], [1, 1, 4]
    got = logits.clone()
    apply_penalties(got, params, prompt, output)
    # token 0: prompt, positive -> 2/2; token 1: output x2, negative -> -1*2 - 0.5*2 - 0.25;
    # token 3: prompt, negative -> -3*2; token 4: output x1 -> 1/2 - 0.5 - 0.25; others untouched.
    expected = torch.tensor([1.0, -3.25, 0.5, -6.0, -0.25, 0.0])
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_frequency_and_presence_ignore_prompt_tokens():
    logits = torch.zeros(4)
    apply_penalties(logits, SamplingParams(frequency_penalty=1.0, presence_penalty=1.0), [0, 0, 1], [2])
    torch.testing.assert_close(logits, torch.tensor([0.0, 0.0, -2.0, 0.0]))


def test_penalised_greedy_choice_and_raw_logprobs():
    logits = torch.tensor([[3.0, 2.5, 0.0, -1.0]])
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, logprobs=2)
    out = Sampler()(logits, [row(params, prompt=[0])])[0]
    # token 0 drops to 1.5 < 2.5, so token 1 wins; logprobs still come from the raw logits.
    assert out.token_id == 1
    raw = torch.log_softmax(logits[0], dim=-1)
    assert out.logprobs[1].logprob == pytest.approx(raw[1].item(), abs=1e-6)
    assert out.logprobs[1].rank == 2
    assert out.logprobs[0].rank == 1
    assert set(out.logprobs) == {0, 1}


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0]])  # 1 is EOS, 2 a stop id
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[2])
    sampler = Sampler()
    assert sampler(logits, [row(params, output=[3], eos=[1])])[0].token_id == 3
    assert sampler(logits, [row(params, output=[3, 3], eos=[1])])[0].token_id == 1
    # ignore_eos: EOS is not a stop, so it is not masked (the stop id still is).
    ignore = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[2], ignore_eos=True)
    assert sampler(logits, [row(ignore, output=[3], eos=[1])])[0].token_id == 1
    # The caller's logits stay untouched.
    assert logits[0, 1].item() == 5.0


# ---------------------------------------------------------------- restricted support

BASE_PROBS = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.01, 0.01])
BASE_LOGITS = BASE_PROBS.log()


@pytest.mark.parametrize(
    ("kwargs", "support"),
    [
        ({"top_k": 3}, {0, 1, 2}),
        ({"top_k": 100}, set(range(8))),
        ({"top_p": 0.7}, {0, 1, 2}),
        ({"top_p": 0.3}, {0}),
        ({"min_p": 0.3}, {0, 1, 2}),
        ({"min_p": 0.2}, {0, 1, 2, 3}),
        ({"temperature": 0.5, "top_p": 0.9}, {0, 1, 2}),
        ({"top_k": 5, "top_p": 0.95, "min_p": 0.2}, {0, 1, 2, 3}),
    ],
)
def test_filters_restrict_the_support(kwargs, support):
    params = SamplingParams(**kwargs)
    probs = restricted_probs(BASE_LOGITS, params)
    assert {i for i, p in enumerate(probs.tolist()) if p > 0} == support
    # Inside the support the distribution is the tempered one, renormalised.
    tempered = torch.softmax(BASE_LOGITS / params.temperature, dim=-1)
    keep = sorted(support)
    torch.testing.assert_close(probs[keep], tempered[keep] / tempered[keep].sum())

    num = 4000
    gen = make_generator(11)
    rows = [row(params, generator=gen) for _ in range(num)]
    tokens = [s.token_id for s in Sampler()(BASE_LOGITS.expand(num, -1), rows)]
    assert set(tokens) == support
    for tok in support:
        p = probs[tok].item()
        freq = tokens.count(tok) / num
        assert abs(freq - p) < 5 * math.sqrt(p * (1 - p) / num) + 1e-9


def test_random_row_without_generator_is_refused():
    with pytest.raises(ValueError, match="generator"):
        Sampler()(torch.zeros(1, 4), [row(SamplingParams(temperature=1.0))])


def test_logits_shape_must_match_rows():
    with pytest.raises(ValueError, match="does not match 2 rows"):
        Sampler()(torch.zeros(3, 4), [row(GREEDY), row(GREEDY)])


# ---------------------------------------------------------------- seeds


def _generate(seed_row_params, steps, batch_fn, seed):
    """Runs `steps` steps; the seeded row goes second when batch_fn adds other rows."""
    gen = make_generator(seed)
    torch.manual_seed(99)
    step_logits = [torch.randn(40) for _ in range(steps)]
    sampler = Sampler()
    output: list[int] = []
    for step in range(steps):
        others = batch_fn(step)
        target = row(seed_row_params, prompt=[1, 2], output=output, generator=gen)
        rows = others[:1] + [target] + others[1:]
        at = min(1, len(others))
        logits = torch.randn(len(rows), 40)
        logits[at] = step_logits[step]
        output.append(sampler(logits, rows)[at].token_id)
    return output


def test_seeded_sampling_is_reproducible_and_batch_independent():
    params = SamplingParams(temperature=1.3, top_p=0.95, repetition_penalty=1.2, seed=5)

    def alone(step):
        return []

    def crowded(step):
        # Other requests, random and greedy, draw from their own generators.
        return [
            row(SamplingParams(temperature=1.0), generator=make_generator(step)),
            row(GREEDY),
            row(SamplingParams(temperature=2.0, top_k=3), generator=make_generator(1000 + step)),
        ]

    solo = _generate(params, 12, alone, seed=5)
    assert _generate(params, 12, alone, seed=5) == solo
    assert _generate(params, 12, crowded, seed=5) == solo
    assert _generate(params, 12, alone, seed=6) != solo


def test_make_generator_accepts_any_int():
    a = torch.rand(3, generator=make_generator(-1))
    b = torch.rand(3, generator=make_generator(2**64 - 1))
    torch.testing.assert_close(a, b)  # -1 wraps to the same 64-bit seed
    assert torch.equal(
        torch.rand(3, generator=make_generator(7)), torch.rand(3, generator=make_generator(7))
    )


# ---------------------------------------------------------------- logprobs


def test_logprobs_hold_sampled_token_and_ranked_top_k():
    torch.manual_seed(1)
    logits = torch.randn(3, 30) * 3
    params = [
        SamplingParams(temperature=0.7, logprobs=4, presence_penalty=1.0),
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(temperature=1.0, logprobs=None),
    ]
    rows = [
        row(params[0], output=[1, 2], generator=make_generator(4)),
        row(params[1]),
        row(params[2], generator=make_generator(5)),
    ]
    out = Sampler()(logits, rows)
    raw = torch.log_softmax(logits, dim=-1)
    order = torch.argsort(raw, dim=-1, descending=True)

    entry = out[0].logprobs
    top4 = order[0, :4].tolist()
    assert set(entry) == set(top4) | {out[0].token_id}
    for rank, tok in enumerate(top4, start=1):
        assert entry[tok].rank == rank
    tok = out[0].token_id
    assert entry[tok].rank == order[0].tolist().index(tok) + 1
    for t, lp in entry.items():
        assert lp.logprob == pytest.approx(raw[0, t].item(), abs=1e-6)

    assert list(out[1].logprobs) == [out[1].token_id]
    assert out[1].logprobs[out[1].token_id].rank == 1
    assert out[2].logprobs is None


def test_prompt_logprobs_match_log_softmax():
    torch.manual_seed(2)
    logits = torch.randn(5, 20)
    targets = [3, 0, 19, 7, 7]
    entries = prompt_logprobs(logits, targets, num_top=2)
    raw = torch.log_softmax(logits, dim=-1)
    assert len(entries) == 5
    for i, (entry, tgt) in enumerate(zip(entries, targets)):
        order = torch.argsort(raw[i], descending=True).tolist()
        assert entry[tgt].logprob == pytest.approx(raw[i, tgt].item(), abs=1e-6)
        assert entry[tgt].rank == order.index(tgt) + 1
        assert set(entry) == {tgt, *order[:2]}
        assert entry[order[0]].rank == 1 and entry[order[1]].rank == 2
    assert all(len(e) == 1 for e in prompt_logprobs(logits, targets, num_top=0))
    assert prompt_logprobs(torch.zeros(0, 20), [], num_top=3) == []
    with pytest.raises(ValueError, match="target ids"):
        prompt_logprobs(logits, targets[:4], num_top=1)
