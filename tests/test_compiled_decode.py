"""compile_decode: decode steps through torch.compile give the eager engine's tokens and logprobs.

One engine run covers every graph variant a decode step selects: one request (a contiguous window of the pool),
requests of different lengths (a padding mask), requests sharing a long prefix (shared keys), one request again
(its prompt now a prefix-cache hit, so its slots are gathered), and batches that mix a prompt chunk with decode
tokens (which run eager). Measured differences against the eager
engine on the tiny Llama: logprobs within 2e-6 (bound 1e-4); greedy tokens identical.
"""

from __future__ import annotations

import random

import pytest
import torch

import tiny_models as tm  # tests/ is on sys.path under pytest
from cpllm import LLM, SamplingParams
from cpllm.layers.gqa.local_attention import reduction_attention
from cpllm.context_parallel.sdpa import reference_attention
from cpllm.engine.llm import build_engine_config
from cpllm.model.execution import fused_decode


def test_reduction_attention_matches_reference():
    """The compiled path's attention form, run eagerly: GQA, several queries per row, a padding mask."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape, generator=gen) for shape in ((2, 6, 3, 8), (2, 2, 10, 8), (2, 2, 10, 8)))
    mask = torch.zeros(2, 1, 3, 10)
    mask[0, :, :, 7:] = float("-inf")  # the first batch row sees 7 keys
    out = reduction_attention(q, k, v, 0.35, mask)
    expected, _ = reference_attention(q.double(), k.double(), v.double(), scale=0.35, mask=mask.double())
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-5)


def _prompts(vocab: int) -> list[list[list[int]]]:
    rng = random.Random(3)
    shared = [rng.randrange(vocab) for _ in range(40)]
    rounds = [
        [[rng.randrange(vocab) for _ in range(21)]],  # one request
        [[rng.randrange(vocab) for _ in range(n)] for n in (5, 33, 12)],  # different lengths
        [shared + [rng.randrange(vocab) for _ in range(n)] for n in (1, 3, 2)],  # a long shared prefix
    ]
    return rounds + [rounds[0]]  # a prefix-cache hit: the new blocks are not next to the cached ones


@pytest.fixture(autouse=True)
def _no_fused_layers(monkeypatch):
    """The fused decode layers take precedence over the compiled step where they apply (cpllm/worker/runner.py):
    turned off here, so every decode step of these runs is the compiled graph under test."""
    monkeypatch.setattr(fused_decode.FusedDecode, "build", classmethod(lambda cls, model: None))


def _generate(folder: str, rounds, compile_decode: bool, kv_cache_dtype: str):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    with LLM(folder, max_model_len=128, block_size=4, quantization="none", compile_decode=compile_decode,
             kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=24) as llm:  # 24: the 33-token prompt is chunked while others decode
        outputs = [out.outputs[0] for prompts in rounds
                   for out in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
        return outputs, llm.engine.executor.rank_stats().compiled_steps


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16"])
def test_compiled_decode_matches_eager(tmp_path, kv_cache_dtype):
    """With bfloat16 K/V the compiled graph reads the pool as stored and converts in registers."""
    folder = tm.save_tiny_hf_model(str(tmp_path / "tiny"), seed=5)
    rounds = _prompts(tm.tiny_hf_config().vocab_size)
    eager, _ = _generate(folder, rounds, compile_decode=False, kv_cache_dtype=kv_cache_dtype)
    compiled, steps = _generate(folder, rounds, compile_decode=True, kv_cache_dtype=kv_cache_dtype)
    assert steps > 0
    for a, b in zip(eager, compiled, strict=True):
        assert a.token_ids == b.token_ids
        for lp_a, lp_b in zip(a.logprobs, b.logprobs, strict=True):
            assert lp_a.keys() == lp_b.keys()
            for token in lp_a:
                assert abs(lp_a[token].logprob - lp_b[token].logprob) < 1e-4


@pytest.mark.parametrize("options, message", [
    ({"tensor_parallel_size": 2}, "one rank per replica"),
    ({"prefill_context_parallel_size": 2}, "one rank per replica"),
])
def test_compile_decode_refuses_layouts_with_collectives(tmp_path, options, message):
    folder = tm.save_tiny_hf_model(str(tmp_path / "tiny"), seed=5)
    with pytest.raises(ValueError, match=message):
        build_engine_config(folder, compile_decode=True, **options)


def test_compile_decode_refuses_moe_models(tmp_path):
    from tiny_moe_models import save_tiny_moe_model

    folder = save_tiny_moe_model(str(tmp_path / "moe"), "qwen3_moe", seed=1)
    with pytest.raises(ValueError, match="mixture-of-experts"):
        build_engine_config(folder, compile_decode=True)
