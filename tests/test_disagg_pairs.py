"""Disaggregated prefill/decode between multi-rank layouts of a GQA model (a tiny Llama with one KV head), through
`cpllm router` in front of two `cpllm serve` processes (one process holds one multi-rank world, so both sides
are servers): the K/V moves from the producer rank that owns each position to the consumer rank(s) that own it,
whatever either side's TP, PCP, DCP, KV layout, interleave and block size. Greedy tokens through the router are
the offline single rank's, logprobs within 1e-4. The pairs here:
- PCP = 2 (interleave 2, block size 4) into TP = 2 x DCP = 2 (interleave 4, block size 8);
- TP = 2 x PCP = 2 x DCP = 2 (4 ranks, the K/V sharded over PCP x DCP at interleave 2) into PCP = 2 with the
  replicated layout (each of its ranks holds every position, pulled from the producer ranks owning them)."""

from __future__ import annotations

import pytest
from test_disagg_engine import free_ports
from test_disagg_router import Router, assert_router_matches, kv_flag
from tiny_models import save_tiny_hf_model

from cpllm import LLM, SamplingParams
from cpllm.server.process import ServerProcess
from parallel_helpers import random_prompt

ENGINE = ["--max-model-len", "128", "--kv-cache-memory-bytes", "1MiB", "--quantization", "none",
          "--threads-per-rank", "1", "--served-model-name", "tiny", "--no-enable-prefix-caching"]
PROMPTS = [random_prompt(13, seed=13), random_prompt(37, seed=37)]
MAX_TOKENS = 6
PAIRS = {
    "pcp2-i2-to-tp2-dcp2-i4": (["-pcp", "2", "--cp-kv-cache-interleave-size", "2", "--block-size", "4"], 2,
                               ["-tp", "2", "-dcp", "2", "--cp-kv-cache-interleave-size", "4", "--block-size", "8"], 2),
    "tp2-pcp2-dcp2-to-pcp2-replicated": (
        ["-tp", "2", "-pcp", "2", "-dcp", "2", "--cp-kv-cache-interleave-size", "2", "--block-size", "4"], 4,
        ["-pcp", "2", "--cp-kv-cache-layout", "replicated", "--block-size", "8"], 2),
}
"""Pair -> (producer flags, its ranks, consumer flags, its ranks)."""


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = save_tiny_hf_model(str(tmp_path_factory.mktemp("kv1")), "llama", seed=3, num_key_value_heads=1)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=1, ignore_eos=True)
    with LLM(folder, max_model_len=128, block_size=8, kv_cache_memory_bytes=2**20, quantization="none",
             threads_per_rank=1) as llm:
        return folder, [llm.generate({"prompt_token_ids": p}, params)[0].outputs[0] for p in PROMPTS]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("pair", sorted(PAIRS))
def test_pair_through_the_router_equals_one_rank(model, pair):
    folder, offline = model
    producer_flags, producer_ranks, consumer_flags, consumer_ranks = PAIRS[pair]
    prefill = [folder, *ENGINE, *producer_flags, *kv_flag("kv_producer", free_ports(producer_ranks + 1))]
    decode = [folder, *ENGINE, *consumer_flags, *kv_flag("kv_consumer", free_ports(consumer_ranks + 1))]
    with ServerProcess.running(prefill, timeout_s=300) as p, ServerProcess.running(decode, timeout_s=300) as d:
        router = Router([p.url], [d.url])
        try:
            assert_router_matches(router.url, PROMPTS, offline, MAX_TOKENS)
            assert "pulled" in d.log()  # the decode side pulled the K/V (rank_transfer's line per pull)
        finally:
            router.close()
