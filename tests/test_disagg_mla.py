"""Disaggregated prefill/decode of an MLA model (a tiny GLM-4.7-Flash: one latent pool per layer, MoE) through
`cpllm router`: a PCP = 2 prefill server (interleave 2, block size 4) feeds a TP = 2 x DCP = 2 decode server
(block size 8), where every TP rank holds the latent and DCP splits its positions, so the latent rows travel as
the plan's one "KV head". Greedy tokens through the router are the offline single rank's, logprobs within 1e-4.
(Servers, not two LLMs in one process: one process holds one multi-rank world.)"""

from __future__ import annotations

import httpx
from test_disagg_engine import free_ports
from test_disagg_router import Router, assert_router_matches, kv_flag
from tiny_deepseek import save_tiny_deepseek

from cpllm import LLM, SamplingParams
from cpllm.server.process import ServerProcess
from parallel_helpers import random_prompt

ENGINE = ["--max-model-len", "128", "--kv-cache-memory-bytes", "1MiB", "--quantization", "none",
          "--threads-per-rank", "1", "--served-model-name", "tiny"]
PROMPTS = [random_prompt(13, seed=13), random_prompt(37, seed=37)]
MAX_TOKENS = 6


def test_mla_pcp2_prefill_to_tp2_dcp2_decode_through_the_router(tmp_path):
    folder = save_tiny_deepseek(str(tmp_path / "glm"), "glm", seed=3)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=1, ignore_eos=True)
    with LLM(folder, max_model_len=128, block_size=8, kv_cache_memory_bytes=2**20, quantization="none",
             threads_per_rank=1) as llm:
        offline = [llm.generate({"prompt_token_ids": p}, params)[0].outputs[0] for p in PROMPTS]
    prefill = [folder, *ENGINE, "-pcp", "2", "--cp-kv-cache-interleave-size", "2", "--block-size", "4",
               *kv_flag("kv_producer", free_ports(3))]
    decode = [folder, *ENGINE, "-tp", "2", "-dcp", "2", "--block-size", "8", *kv_flag("kv_consumer", free_ports(3))]
    with ServerProcess.running(prefill, timeout_s=300) as p, ServerProcess.running(decode, timeout_s=300) as d:
        router = Router([p.url], [d.url])
        try:
            assert_router_matches(router.url, PROMPTS, offline, MAX_TOKENS)
            body = httpx.get(f"{router.url}/health", timeout=30).json()
            assert body["prefill"][0]["sent"] == body["decode"][0]["sent"] == len(PROMPTS)
        finally:
            router.close()
