"""Prompt-lookup speculation on DeepSeek sparse attention (tiny DeepSeek-V3.2, index_topk 8): greedy with drafts is
token for token, logprob for logprob (1e-4), the engine without them, on one rank and under TP=2 x DCP=2 and PCP=2
(real gloo processes). Each verified position selects its own top-k over the prefix up to it: a verify chunk's rows
reach the layer as decode rows (or, beside a prompt chunk under PCP or DCP, as a chunk masking the positions after
each row). prompt_lookup_min=1 with fixed draft lengths drafts at almost every step, mostly wrongly, so rejected
drafts (their latent rows and index keys overwritten by the next step) are many; prompts of 1 token (dense), 13, 31 and
37 (selecting), a 9-token step budget so verify chunks ride beside prompt chunks."""

from __future__ import annotations

import pytest

from cpllm import LLM
from parallel_helpers import assert_same_greedy, generate_counted, greedy_params, workload_prompts
from tiny_sparse_mla import save_tiny_sparse

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
        "draft_length": "fixed"}
MAX_TOKENS = 10
COMMON = dict(quantization="none", max_model_len=128, block_size=4, max_num_batched_tokens=9,
              kv_cache_memory_bytes=2**20, threads_per_rank=1, distributed_timeout=60)
LAYOUTS = {"one": {}, "tp2-dcp2": {"tensor_parallel_size": 2, "decode_context_parallel_size": 2},
           "pcp2": {"prefill_context_parallel_size": 2}}


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
