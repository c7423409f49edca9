"""Kimi Linear under TP, TP x DCP, PCP (both KV layouts) and TP x PCP x DCP against the single-rank engine on the
same tiny weights (tests/tiny_kimi.py; tests/test_kimi_linear_vs_hf.py holds the single rank to transformers).

Each rank holds num_heads / TP whole heads of every Kimi delta attention layer and those heads' states; the MLA
layer's latent rows are replicated over TP, sharded over DCP (every TP rank of a DCP group holds the same heads'
states, so they need nothing more). Under PCP a prompt chunk is split head-tail over the PCP ranks and the KDA
states go through the state scan (docs/context_parallel.md, "State scan"): the convolution's halo all-gathered,
each run from [0 | I], the runs' affine maps composed in sequence order; every PCP rank then runs the decode rows
alike. The workload: prompts of 3, 5 and 70 tokens under a 16-token step budget, so the 70-token prompt runs
chunked prefill (its later chunks start from the state the earlier ones left, split over PCP) beside decode rows.
One launch per layout, the single-rank reference once per module. Greedy tokens identical, prompt and
sampled-token logprobs within 1e-4.
"""

from __future__ import annotations

import pytest

from cpllm import LLM
from parallel_helpers import assert_same_greedy, generate_counted, greedy_params, random_prompt
from tiny_kimi import save_tiny_kimi

MAX_TOKENS = 6
COMMON = dict(quantization="none", max_model_len=128, block_size=4, max_num_batched_tokens=16,
              kv_cache_memory_bytes=2**20, max_num_seqs=8, threads_per_rank=1, distributed_timeout=60)
PROMPTS = {f"p{n}": random_prompt(n, seed=n) for n in (3, 5, 70)}
LAYOUTS = {
    "tp2": dict(tensor_parallel_size=2),
    "tp2-dcp2": dict(tensor_parallel_size=2, decode_context_parallel_size=2, cp_kv_cache_interleave_size=2),
    "pcp2": dict(prefill_context_parallel_size=2, cp_prefill_strategy="allgather"),
    "pcp2-replicated-ring": dict(prefill_context_parallel_size=2, cp_kv_cache_layout="replicated",
                                 cp_prefill_strategy="ring"),
    "tp2-pcp2-dcp2-passq": dict(tensor_parallel_size=2, prefill_context_parallel_size=2,
                                decode_context_parallel_size=2, cp_prefill_strategy="pass-q",
                                cp_kv_cache_interleave_size=4),
}
"""Five launches, two on 4 ranks: TP=2 (heads and states split); TP=2 x DCP=2 (latents sharded over the TP ranks,
interleave 2, states as TP=2's); PCP=2 all-gather under the sharded layout; PCP=2 with the pass-KV ring under the
replicated layout (decode rows never split over the PCP copies: every copy advances every state); TP=2 x PCP=2 x
DCP=2 with pass-Q (the state scan over each TP rank's heads, latents sharded over 4 ranks, interleave = block
size)."""


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = save_tiny_kimi(str(tmp_path_factory.mktemp("kimi")), seed=1)
    with LLM(folder, **COMMON) as llm:
        reference = generate_counted(llm, PROMPTS, greedy_params(MAX_TOKENS, prompt_logprobs=True), "ref")
    return folder, reference


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_layout_matches_single_rank(model, name):
    folder, reference = model
    with LLM(folder, **COMMON, **LAYOUTS[name]) as llm:
        outputs = generate_counted(llm, PROMPTS, greedy_params(MAX_TOKENS, prompt_logprobs=True), name)
    for prompt, output in outputs.items():
        assert len(output.outputs[0].token_ids) == MAX_TOKENS
        assert_same_greedy(output, reference[prompt], what=f"{name} {prompt}", prompt_logprobs=True)
