"""Speculation on DeepSeek sparse attention (tiny DeepSeek-V3.2, index_topk 8), by prompt lookup and by a draft model:
greedy with drafts is token for token, logprob for logprob (1e-4), the engine without them, on one rank and under
TP=2 x DCP=2, PCP=2 (both KV layouts) and TP=2 x PCP=2 x DCP=2 (real gloo processes). Each verified position selects
its own top-k over the prefix up to it: a verify chunk's rows reach the layer as decode rows (or, beside a prompt
chunk under PCP or DCP, as a chunk masking the positions after each row). prompt_lookup_min=1 with fixed draft
lengths drafts at almost every step, mostly wrongly, so rejected drafts (their latent rows and index keys
overwritten by the next step) are many; prompts of 1 token (dense), 13, 31 and 37 (selecting), a 9-token step budget
so verify chunks ride beside prompt chunks. The draft model is the tiny Llama of tests/spec_decode_helpers.py whose
greedy walk follows a successor map, and the target is set to follow the same map, so that its drafts are accepted."""

from __future__ import annotations

import pytest

import torch

from cpllm import LLM
from parallel_helpers import assert_same_greedy, generate_counted, greedy_params, workload_prompts
from spec_decode_helpers import save_cycle_model, successor_map, walk
from tiny_models import tiny_hf_tokenizer
from tiny_sparse_mla import make_tiny_sparse, save_tiny_sparse

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
        "draft_length": "fixed"}
MAX_TOKENS = 10
COMMON = dict(quantization="none", max_model_len=128, block_size=4, max_num_batched_tokens=9,
              kv_cache_memory_bytes=2**20, threads_per_rank=1, distributed_timeout=60)
LAYOUTS = {"one": {}, "tp2-dcp2": {"tensor_parallel_size": 2, "decode_context_parallel_size": 2},
           "pcp2": {"prefill_context_parallel_size": 2},
           "pcp2-replicated": {"prefill_context_parallel_size": 2, "cp_kv_cache_layout": "replicated"},
           "tp2-pcp2-dcp2": {"tensor_parallel_size": 2, "prefill_context_parallel_size": 2,
                             "decode_context_parallel_size": 2, "cp_kv_cache_interleave_size": 2}}


def run(folder: str, spec: dict | None, **options) -> tuple[dict, int]:
    with LLM(folder, **COMMON, **options, **({"speculative_config": spec} if spec else {})) as llm:
        outputs = generate_counted(llm, workload_prompts(1), greedy_params(MAX_TOKENS, prompt_logprobs=False), "s")
        return outputs, llm.engine.spec_decode_totals.num_draft_tokens


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = save_tiny_sparse(str(tmp_path_factory.mktemp("v32")), "v32", seed=1)
    return folder, run(folder, None)[0]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_prompt_lookup_equals_no_speculation(model, layout):
    folder, reference = model
    outputs, drafted = run(folder, SPEC, **LAYOUTS[layout])
    assert drafted > 0, "prompt lookup drafted nothing: the test would not verify a draft"
    for name, output in outputs.items():
        assert_same_greedy(output, reference[name], what=f"{layout} {name}", prompt_logprobs=False)


def save_cycle_sparse(folder: str, seed: int) -> tuple[str, dict[int, int]]:
    """The tiny DeepSeek-V3.2 with its LM head set so greedy decoding follows the successor map: the embedding
    scaled up and the layers' output projections down, so the last hidden state stays near the current token's
    embedding (the layers still add their share: the logprobs compared see the selection)."""
    model = make_tiny_sparse("v32", seed=seed)
    successor = successor_map(model.config.vocab_size, seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "embed_tokens" in name:
                param.mul_(50.0)
            elif "o_proj" in name or "down_proj" in name:
                param.mul_(0.05)
        embed, head = model.model.embed_tokens.weight, torch.zeros_like(model.lm_head.weight)
        for token, nxt in successor.items():
            head[nxt] = embed[token] * 2.0
        model.lm_head.weight.copy_(head)
    model.save_pretrained(folder)
    tiny_hf_tokenizer().save_pretrained(folder)
    return folder, successor


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", ["one", "tp2-dcp2"])
def test_draft_model_equals_no_speculation(tmp_path_factory, layout):
    target, successor = save_cycle_sparse(str(tmp_path_factory.mktemp("cycle_v32")), seed=1)
    draft, _ = save_cycle_model(str(tmp_path_factory.mktemp("cycle_llama")), seed=1, scale=2.0)
    prompts = {f"walk{start}": walk(successor, start, 14) for start in (10, 50)}
    prompts["long"] = walk(successor, 90, 37)  # selects 8 of its keys in prefill and in every verify step
    params = greedy_params(MAX_TOKENS, prompt_logprobs=False)
    spec = {"model": draft, "num_speculative_tokens": 3, "draft_length": "fixed"}
    with LLM(target, **COMMON, **LAYOUTS[layout]) as llm:
        reference = generate_counted(llm, prompts, params, "ref")
    with LLM(target, **COMMON, **LAYOUTS[layout], speculative_config=spec) as llm:
        outputs = generate_counted(llm, prompts, params, "draft")
        totals = llm.engine.spec_decode_totals
    assert totals.num_accepted_tokens > 0  # drafts verified and kept (rejected ones: the prompt-lookup test)
    for name, output in outputs.items():
        assert_same_greedy(output, reference[name], what=f"{layout} {name}", prompt_logprobs=False)
