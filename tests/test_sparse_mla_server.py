"""`cpllm serve` on a tiny GLM-5 (DeepSeek sparse attention, index_topk 8) under TP=2 x DCP=2: the completions the
openai client gets, logprobs included, are the offline single-rank engine's (the prompts run longer than 8 tokens,
so every query past the eighth selects across both ranks' shards); chat answers."""

from __future__ import annotations

import openai
import pytest
from tiny_sparse_mla import INDEX_TOPK, save_tiny_sparse

from cpllm import LLM, SamplingParams
from cpllm.server.process import ServerProcess

ENGINE = ["--max-model-len", "128", "--block-size", "4", "--kv-cache-memory-bytes", "1MiB", "--quantization", "none",
          "--threads-per-rank", "1"]
PROMPTS = ["hello world, the cat sat on the mat", "a b c a b c a b"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return save_tiny_sparse(str(tmp_path_factory.mktemp("sparse_server")), "glm5", seed=3)


def test_served_completions_equal_the_offline_single_rank(folder):
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=1)
    with LLM(folder, max_model_len=128, block_size=4, kv_cache_memory_bytes=2**20, quantization="none") as llm:
        offline = llm.generate(PROMPTS, params)
    assert all(len(out.prompt_token_ids) > INDEX_TOPK for out in offline)  # selection happens
    with ServerProcess.running([folder, "-tp", "2", "-dcp", "2", *ENGINE]) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=120, max_retries=0)
        for prompt, out in zip(PROMPTS, offline):
            want = out.outputs[0]
            got = client.completions.create(model=folder, prompt=prompt, max_tokens=6, temperature=0, logprobs=1)
            choice = got.choices[0]
            assert choice.text == want.text
            assert choice.logprobs.token_logprobs == pytest.approx([lp[t].logprob for lp, t in
                                                                    zip(want.logprobs, want.token_ids)], abs=1e-4)
        chat = client.chat.completions.create(model=folder, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=4, temperature=0)
        assert chat.choices[0].finish_reason in ("length", "stop")
