"""Prefix caching and speculative decoding on Kimi Linear (tiny random model, tests/tiny_kimi.py), each against the
same engine without it, as tests/test_qwen3_5_prefix_spec.py does for the gated-DeltaNet hybrids.

Prefix caching: a hit starts from the snapshot of the Kimi delta attention states taken where a chunk ended at a
block boundary (cpllm/engine/state_snapshots.py, kind-free): prompts sharing prefixes, run one at a time and again,
give the tokens of a run without the cache and logprobs within 1e-4, on one rank and under PCP = 2; the hits and
snapshots are counted.

Speculative decoding: a verify chunk's Kimi delta attention states go through its known tokens only, its drafts
scored from them and their updates dropped (cpllm/layers/kimi_delta/layer.py `_chunk`), so greedy output with
prompt lookup is token for token the run without speculation, with drafts accepted (the LM head set to follow the
successor map of tests/spec_decode_helpers.py). Speculation under PCP and a Kimi draft model are refused.
"""

from __future__ import annotations

import random

import pytest
import torch

from cpllm import LLM, SamplingParams
from cpllm.config.engine import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from cpllm.config.speculative import SpeculativeConfig
from cpllm.model.loaders.safetensors_source import read_hf_config
from spec_decode_helpers import successor_map, walk
from test_qwen3_5_prefix_spec import PCP_OPTIONS, assert_same, run_one_by_one, shared_prompts
from tiny_kimi import make_tiny_kimi, save_tiny_kimi
from tiny_models import tiny_hf_tokenizer


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_kimi(str(tmp_path_factory.mktemp("kimi")), seed=1)


def test_prefix_hits_match_no_cache(folder):
    prompts = shared_prompts()
    expected, _ = run_one_by_one(folder, prompts, enable_prefix_caching=False)
    outputs, counts = run_one_by_one(folder, prompts, enable_prefix_caching=True)
    assert_same(outputs, expected)
    # the third prompt (the shared prefix) resumes at 36 from the snapshot the second took at its branch point;
    # the second round resumes every prompt at its last boundary
    assert [o.num_cached_tokens for o in outputs] == [0, 0, 36, 0, 40, 44, 36, 16]
    assert counts == dict(hit_tokens=172, saved=4, restored=5)


def test_prefix_hits_under_pcp2(folder):
    prompts = shared_prompts()[:3] + shared_prompts()[4:7]
    expected, _ = run_one_by_one(folder, prompts, enable_prefix_caching=False)
    outputs, counts = run_one_by_one(folder, prompts, enable_prefix_caching=True, prefill_context_parallel_size=2,
                                     **PCP_OPTIONS)
    assert_same(outputs, expected)
    assert counts["restored"] == 4 and counts["hit_tokens"] > 0


EMBED_SCALE = 40.0
"""The cycle model's embeddings are scaled up this much: the layers (pre-norm: they see the same normalised input
whatever the scale) add some 30x the plain embeddings' norm to the residual stream, its MLA layer most, which
would hide the current token from the LM head; at 40 most greedy tokens follow the successor map, some leave it."""


def save_cycle_kimi(folder: str, seed: int) -> tuple[str, dict[int, int]]:
    """The tiny Kimi Linear with its embeddings scaled up (EMBED_SCALE) and its LM head's row for token s(a) set to
    a's embedding, so greedy decoding mostly follows the successor map and prompt lookup drafts well."""
    model = make_tiny_kimi(seed=seed)
    successor = successor_map(model.config.vocab_size, seed)
    with torch.no_grad():
        embed = model.model.embed_tokens.weight
        head = torch.zeros_like(model.lm_head.weight)
        for token, nxt in successor.items():
            head[nxt] = embed[token] * 2.0
        embed.mul_(EMBED_SCALE)
        model.lm_head.weight.copy_(head)
    model.save_pretrained(folder)
    tiny_hf_tokenizer().save_pretrained(folder)
    return folder, successor


def test_ngram_spec_decoding_is_greedy_identical(tmp_path):
    model, successor = save_cycle_kimi(str(tmp_path / "cycle_kimi"), seed=1)
    rng = random.Random(0)
    prompts = [walk(successor, start, 12) for start in (10, 50, 90)] + [[rng.randrange(3, 300) for _ in range(20)]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    spec = dict(method="ngram", num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1)
    options = dict(max_model_len=128, block_size=4, quantization="none")
    with LLM(model, **options) as llm:
        expected = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    with LLM(model, speculative_config=spec, **options) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        totals = llm.engine.spec_decode_totals
    assert_same(outputs, expected)
    assert totals.num_accepted_tokens > 0  # accepted drafts were computed again from the kept state


def test_spec_refused_under_pcp_and_with_a_kimi_draft(folder):
    plain = dict(model_path=folder, model=read_hf_config(folder), scheduler=SchedulerConfig(max_model_len=128),
                 cache=CacheConfig(enable_prefix_caching=False))
    ngram = SpeculativeConfig(method="ngram", num_speculative_tokens=2)
    EngineConfig(**plain, speculative_config=ngram)  # accepted on one rank
    with pytest.raises(ValueError, match="Kimi Linear under prefill_context_parallel_size=2"):
        EngineConfig(**plain, speculative_config=ngram, parallel=ParallelConfig(prefill_context_parallel_size=2))
    with pytest.raises(ValueError, match="draft model with state layers"):
        LLM(folder, max_model_len=128, quantization="none", speculative_config={"model": folder,
                                                                                "num_speculative_tokens": 2})
