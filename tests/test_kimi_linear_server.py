"""`cpllm serve` on a tiny Kimi Linear model (Kimi delta attention states per request, MLA without rotary, the
DeepSeek MoE) under TP=2: the completions the openai client gets, logprobs included, are the offline single-rank
engine's; chat answers."""

from __future__ import annotations

import openai
import pytest
from tiny_kimi import save_tiny_kimi

from cpllm import LLM, SamplingParams
from cpllm.server.process import ServerProcess

ENGINE = ["--max-model-len", "128", "--block-size", "4", "--kv-cache-memory-bytes", "2MiB", "--quantization", "none",
          "--threads-per-rank", "1", "--max-num-seqs", "4"]
PROMPTS = ["hello world, the cat sat on the mat", "a b c a b c a b"]


def test_served_completions_equal_the_offline_single_rank(tmp_path):
    folder = save_tiny_kimi(str(tmp_path), seed=3)
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=1)
    with LLM(folder, max_model_len=128, block_size=4, kv_cache_memory_bytes=2**21, quantization="none",
             max_num_seqs=4) as llm:
        offline = [out.outputs[0] for out in llm.generate(PROMPTS, params)]
    with ServerProcess.running([folder, "-tp", "2", *ENGINE]) as server:  # prefix caching off by default here
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=120, max_retries=0)
        for prompt, want in zip(PROMPTS, offline):
            got = client.completions.create(model=folder, prompt=prompt, max_tokens=6, temperature=0, logprobs=1)
            choice = got.choices[0]
            assert choice.text == want.text
            assert choice.logprobs.token_logprobs == pytest.approx([lp[t].logprob for lp, t in
                                                                    zip(want.logprobs, want.token_ids)], abs=1e-4)
        chat = client.chat.completions.create(model=folder, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=4, temperature=0)
        assert chat.choices[0].finish_reason in ("length", "stop")
