"""DeepSeek-V2 / V3 / GLM-4.7-Flash (MLA over one latent pool per layer, DeepSeek MoE) under parallel layouts
against the single-rank engine (real gloo processes), and the latent cache's bytes per rank.

Each layout launches once (LaunchCache) and runs the shared workload (tests/parallel_helpers.py): prompts of
lengths {1, 2*PCP-1, 13, 37} plus one sharing a 24-token prefix, a 9-token step budget (chunked prefill over
cached latents, decodes riding along with chunks), then the same prompts again (prefix-cache hits, decode-only
steps). Greedy tokens identical, prompt and sampled-token logprobs within 1e-4 of the single rank (which
tests/test_deepseek_vs_hf.py holds to transformers).

The latent pool is one "KV head" every TP rank holds, so DCP may be any divisor of TP: under TP=2 x DCP=2 each
TP rank stores every other latent row (interleave 2) and decode gathers both ranks' queries. The capacity test
reads the pools each rank allocated: TP=2 x DCP=2 holds 1/DCP of TP=2's latent bytes per token and per rank,
and at the same kv_cache_memory_bytes a request that one rank's pools cannot hold is served with DCP=2 and
refused without it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest

from cpllm import LLM, SamplingParams
from parallel_helpers import (
    BLOCK_SIZE,
    MAX_MODEL_LEN,
    MAX_NUM_BATCHED_TOKENS,
    MODEL_SEED,
    LaunchCache,
    assert_same_greedy,
    generate_counted,
    greedy_params,
    workload_prompts,
)
from tiny_deepseek import save_tiny_deepseek

MAX_TOKENS = 8
COMMON = dict(quantization="none", max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE,
              max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, kv_cache_memory_bytes=2**20, threads_per_rank=1,
              distributed_timeout=60)
LATENT_WIDTH, NUM_LAYERS, FLOAT32 = 48, 3, 4
"""The tiny models' latent row (kv_lora_rank 32 + rope 16), layers, and bytes per value."""


@dataclass(frozen=True, slots=True)
class MLALayout:
    case: str
    tp: int = 1
    pcp: int = 1
    dcp: int = 1
    ep: bool = False
    strategy: str = "allgather"
    interleave: int = 1
    kv_layout: str = "sharded"

    def label(self) -> str:
        parts = [self.case, f"tp{self.tp}", f"pcp{self.pcp}", f"dcp{self.dcp}", f"i{self.interleave}"]
        parts += [self.strategy] if self.pcp > 1 else []
        parts += [self.kv_layout] if self.kv_layout != "sharded" else []
        return "-".join(parts + (["ep"] if self.ep else []))

    def engine_options(self) -> dict:
        return dict(tensor_parallel_size=self.tp, prefill_context_parallel_size=self.pcp,
                    decode_context_parallel_size=self.dcp, enable_expert_parallel=self.ep,
                    cp_prefill_strategy=self.strategy, cp_kv_cache_interleave_size=self.interleave,
                    cp_kv_cache_layout=self.kv_layout)


LAYOUTS = [
    MLALayout("v3-yarn", tp=2),
    MLALayout("v2-lora-groups-yarn", tp=2, dcp=2, interleave=2, ep=True),
    MLALayout("glm", pcp=2, strategy="ring"),
    MLALayout("v3-direct", tp=2, pcp=2, dcp=2, strategy="pass-q", interleave=4),
    MLALayout("v2", pcp=2, strategy="allgather", ep=True, kv_layout="replicated"),
    MLALayout("v3-yarn", pcp=2, strategy="allgather"),
    MLALayout("glm", pcp=2, strategy="pass-q", interleave=4),
]
"""Seven launches, one on 4 ranks: TP=2 (latents replicated, the MoE group is the TP group); TP=2 x DCP=2 with
EP (latents sharded over the TP ranks, interleave 2); PCP=2 with the pass-KV ring (latent rows travel, prefix
hits read sharded latents); TP=2 x PCP=2 x DCP=2 with pass-Q (queries travel, latents sharded over 4 ranks,
interleave = block size); PCP=2 all-gather under the replicated layout with EP (a whole latent copy per PCP rank,
decode rows split over PCP and their latents synced); and PCP=2 alone under the sharded layout with the other two
strategies (all-gather of latent rows; pass-Q)."""


@dataclass
class Run:
    first: dict
    second: dict
    prefix_hits: int
    kv_bytes: int
    num_blocks: int


class Launches(LaunchCache):
    def folder(self, case: str) -> str:
        if case not in self._folders:
            self._folders[case] = save_tiny_deepseek(str(self._tmp.mktemp(case)), case, seed=MODEL_SEED)
        return self._folders[case]

    def reference(self, case: str) -> dict:
        if case not in self._references:
            prompts = {**workload_prompts(1), **workload_prompts(2)}
            with LLM(self.folder(case), **COMMON) as llm:
                self._references[case] = generate_counted(llm, prompts, greedy_params(MAX_TOKENS,
                                                                                         prompt_logprobs=True), "ref")
        return self._references[case]

    def _launch(self, layout: MLALayout) -> Run:
        prompts = workload_prompts(layout.pcp)
        with LLM(self.folder(layout.case), **COMMON, **layout.engine_options()) as llm:
            scheduler = llm.engine.scheduler
            first = generate_counted(llm, prompts, greedy_params(MAX_TOKENS, prompt_logprobs=True), "p1")
            before = scheduler.num_prefix_hit_tokens
            second = generate_counted(llm, prompts, greedy_params(MAX_TOKENS, prompt_logprobs=False), "p2")
            kv = llm.engine.executor.rank_info.kv
            return Run(first=first, second=second, prefix_hits=scheduler.num_prefix_hit_tokens - before,
                       kv_bytes=kv.bytes, num_blocks=kv.num_blocks)


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> Launches:
    return Launches(tmp_path_factory)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", LAYOUTS, ids=MLALayout.label)
def test_layout_matches_single_rank(launches, layout):
    reference = launches.reference(layout.case)
    run = launches.run(layout)
    for name, output in run.first.items():
        assert_same_greedy(output, reference[name], what=f"{layout.label()} pass 1 {name}", prompt_logprobs=True)
    for name, output in run.second.items():
        assert_same_greedy(output, reference[name], what=f"{layout.label()} pass 2 {name}", prompt_logprobs=False)
    assert run.prefix_hits > 0, "pass 2 repeats pass 1's prompts and should hit the prefix cache"
    # one latent pool per layer, [blocks x block_size, 1, 48] float32, read as both K and V
    assert run.kv_bytes == NUM_LAYERS * run.num_blocks * BLOCK_SIZE * LATENT_WIDTH * FLOAT32


CAPACITY_BLOCKS = 16
"""Blocks per rank of the capacity test: 16 x 4 = 64 latent rows per layer pool on each rank."""
LONG = 100
"""Tokens of the request that one rank's pools cannot hold (prompt 92 + 8 generated) but two ranks' can."""


def _capacity_run(folder: str, caplog, **options):
    """(kv bytes per rank, blocks per rank, tokens the replica holds, the latent log line, the long request's
    output or the ValueError refusing it) at the same kv_cache_memory_bytes."""
    budget = CAPACITY_BLOCKS * NUM_LAYERS * BLOCK_SIZE * LATENT_WIDTH * FLOAT32  # one latent pool per layer
    prompt = [3 + (7 * i) % 250 for i in range(LONG - MAX_TOKENS)]
    caplog.clear()
    with LLM(folder, **{**COMMON, "kv_cache_memory_bytes": budget}, **options) as llm:
        kv = llm.engine.executor.rank_info.kv
        line = [r.getMessage() for r in caplog.records if r.getMessage().startswith("latent cache (MLA)")]
        try:
            result = generate_counted(llm, {"long": prompt}, greedy_params(MAX_TOKENS, prompt_logprobs=False),
                                      "cap")["long"]
        except ValueError as error:
            result = error
        return kv.bytes, kv.num_blocks, llm.engine.kv_capacity_tokens, line, result, prompt


@pytest.mark.timeout(600)
def test_dcp_divides_latent_bytes_and_serves_what_tp_refuses(launches, caplog):
    caplog.set_level("INFO", logger="cpllm.engine.engine")
    folder = launches.folder("v3-yarn")
    tp_bytes, tp_blocks, tp_tokens, tp_line, tp_result, prompt = _capacity_run(folder, caplog, tensor_parallel_size=2)
    dcp_bytes, dcp_blocks, dcp_tokens, dcp_line, dcp_result, _ = _capacity_run(
        folder, caplog, tensor_parallel_size=2, decode_context_parallel_size=2)
    # the same pools per rank (the same budget), and every byte a latent row: 48 values x 3 layers x 4 bytes
    assert tp_blocks == dcp_blocks == CAPACITY_BLOCKS
    assert tp_bytes == dcp_bytes == CAPACITY_BLOCKS * BLOCK_SIZE * NUM_LAYERS * LATENT_WIDTH * FLOAT32
    # TP replicates the latents on both ranks; DCP=2 stores each token on one: half the bytes per token per rank
    assert (tp_tokens, dcp_tokens) == (64, 128)
    assert dcp_bytes / dcp_tokens == tp_bytes / tp_tokens / 2
    assert "576 bytes per token stored on a rank" in tp_line[0] and "the replica holds 64 tokens" in tp_line[0]
    assert "divided over 2 rank(s), so 288 bytes per token" in dcp_line[0]
    assert "the replica holds 128 tokens" in dcp_line[0]
    # a 100-token request: refused by TP=2 alone, naming the cache's 64 tokens; served under DCP=2 as one rank
    assert isinstance(tp_result, ValueError) and "holds 64 tokens" in str(tp_result), tp_result
    assert not isinstance(dcp_result, ValueError), dcp_result
    with LLM(folder, **{**COMMON, "max_num_batched_tokens": 128}) as llm:
        want = generate_counted(llm, {"long": prompt}, greedy_params(MAX_TOKENS, prompt_logprobs=False), "one")
    assert_same_greedy(dcp_result, want["long"], what="DCP=2 long request", prompt_logprobs=False)
