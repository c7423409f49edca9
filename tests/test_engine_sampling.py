"""Sampling behaviour seen through the engine: seeds, n, stops, lengths, penalties, input errors."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from cpllm import LLM, SamplingParams
from tiny_models import make_tiny_hf_model, save_tiny_hf_model

PROMPT = [5, 17, 40, 99, 7, 23, 61]
OTHERS = [[9, 8, 7], [100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110], [33]]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    folder = save_tiny_hf_model(str(tmp_path_factory.mktemp("tiny")), "llama", seed=4)
    with LLM(folder, max_model_len=128, block_size=4, max_num_batched_tokens=16) as engine:
        yield engine


def tokens(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, seed=1234, ignore_eos=True)
    alone = tokens(llm, [PROMPT], params)[0]
    again = tokens(llm, [PROMPT], params)[0]
    unseeded = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    in_batch = tokens(llm, [OTHERS[0], PROMPT, OTHERS[1]], [unseeded, params, unseeded])[1]
    assert alone == again == in_batch
    other_seed = tokens(llm, [PROMPT], SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, seed=99,
                                                      ignore_eos=True))[0]
    assert other_seed != alone


def test_n_samples_are_distinct_and_reproducible(llm):
    params = SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=7, ignore_eos=True)
    first = llm.generate({"prompt_token_ids": PROMPT}, params)[0]
    second = llm.generate({"prompt_token_ids": PROMPT}, params)[0]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in first.outputs}) == 3
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in second.outputs]


def test_max_tokens_and_stop_conditions(llm):
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    full = llm.generate({"prompt_token_ids": PROMPT}, greedy)[0].outputs[0]
    assert len(full.token_ids) == 24 and full.finish_reason == "length"

    stop_id = full.token_ids[5]
    by_id = llm.generate({"prompt_token_ids": PROMPT},
                         SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_id]))[0].outputs[0]
    first = full.token_ids.index(stop_id)
    assert by_id.token_ids == full.token_ids[: first + 1]
    assert by_id.finish_reason == "stop" and by_id.stop_reason == stop_id

    stop_text = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    if stop_text and full.text.index(stop_text) > 0:
        by_text = llm.generate({"prompt_token_ids": PROMPT},
                               SamplingParams(temperature=0, max_tokens=24, stop=[stop_text]))[0].outputs[0]
        assert by_text.text == full.text[: full.text.index(stop_text)]
        assert by_text.finish_reason == "stop" and by_text.stop_reason == stop_text


@torch.no_grad()
def penalised_greedy(model, prompt, steps, repetition, frequency, presence):
    """Reference: the documented penalty formulas applied to transformers' logits."""
    out = []
    for _ in range(steps):
        logits = model(torch.tensor([prompt + out])).logits[0, -1].double()
        seen = torch.tensor(sorted(set(prompt + out)))
        picked = logits[seen]
        logits[seen] = torch.where(picked > 0, picked / repetition, picked * repetition)
        for token, count in Counter(out).items():
            logits[token] -= frequency * count + presence
        out.append(int(logits.argmax()))
    return out


def test_penalties_follow_the_formulas(llm, tmp_path):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=1.5,
                            frequency_penalty=0.7, presence_penalty=0.4)
    got = tokens(llm, [PROMPT], params)[0]
    model = make_tiny_hf_model("llama", seed=4)
    assert got == penalised_greedy(model, PROMPT, 16, 1.5, 0.7, 0.4)
    assert got != tokens(llm, [PROMPT], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ([], SamplingParams(), "empty"),
        ([1, 2, 100000], SamplingParams(), "100000"),
        (list(range(3, 120)), SamplingParams(max_tokens=20), "max_model_len=128"),
    ],
)
def test_bad_requests_are_refused(llm, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate({"prompt_token_ids": prompt}, params)
    assert tokens(llm, [PROMPT], SamplingParams(temperature=0, max_tokens=3))[0]  # still serving


def test_invalid_sampling_params_raise():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_dtypes_follow_float32(llm, dtype, tmp_path):
    folder = save_tiny_hf_model(str(tmp_path), "llama", seed=4)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)
    want = llm.generate({"prompt_token_ids": PROMPT}, params)[0].outputs[0]
    with LLM(folder, dtype=dtype, max_model_len=128, block_size=4) as half:
        got = half.generate({"prompt_token_ids": PROMPT}, params)[0].outputs[0]
    assert got.token_ids[0] == want.token_ids[0]
    first = lambda c: next(iter(c.logprobs[0].values())).logprob  # noqa: E731
    assert abs(first(got) - first(want)) < 0.05
