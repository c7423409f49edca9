"""DeepSeek-V3.2 and GLM-5 (DeepSeek sparse attention, index_topk 8) under TP, TP x DCP and PCP (both KV layouts,
TP x PCP too) against the single-rank engine (real gloo processes), and the cache's bytes per rank.

Each layout launches once and runs the shared workload (tests/parallel_helpers.py): prompts of 1, 13 and 37 tokens
plus one sharing a 24-token prefix (the last three select 8 keys per query), a 9-token step budget (chunked
prefill whose queries select over cached latents, decodes riding along with chunks), then the same prompts again
(prefix hits, decode-only steps). Under DCP each rank scores the index keys it holds, the candidates are
all-gathered and every rank keeps the same global top-k (tests/test_sparse_mla_topk.py checks that rule alone);
under PCP the prompt's queries meet the index keys of every PCP rank the same way;
greedy tokens identical and logprobs within 1e-4 of the single rank (which tests/test_sparse_mla_vs_hf.py holds to
transformers).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from cpllm import LLM
from parallel_helpers import (BLOCK_SIZE, MAX_MODEL_LEN, MAX_NUM_BATCHED_TOKENS, MODEL_SEED, LaunchCache,
                              assert_same_greedy, generate_counted, greedy_params, workload_prompts)
from tiny_sparse_mla import save_tiny_sparse

MAX_TOKENS = 8
COMMON = dict(quantization="none", max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE,
              max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, kv_cache_memory_bytes=2**20, threads_per_rank=1,
              distributed_timeout=60)
ROW_VALUES, NUM_LAYERS, FLOAT32 = 48 + 32, 3, 4
"""Values cached per token and layer (latent 48 + index key 32), layers, bytes per value."""


@dataclass(frozen=True, slots=True)
class SparseLayout:
    case: str
    tp: int = 1
    pcp: int = 1
    dcp: int = 1
    interleave: int = 1
    strategy: str = "allgather"
    kv_layout: str = "sharded"

    def label(self) -> str:
        parts = [self.case, f"tp{self.tp}", f"pcp{self.pcp}", f"dcp{self.dcp}", f"i{self.interleave}"]
        parts += [self.strategy, self.kv_layout] if self.pcp > 1 else []
        return "-".join(parts)

    def engine_options(self) -> dict:
        return dict(tensor_parallel_size=self.tp, prefill_context_parallel_size=self.pcp,
                    decode_context_parallel_size=self.dcp, cp_kv_cache_interleave_size=self.interleave,
                    cp_prefill_strategy=self.strategy, cp_kv_cache_layout=self.kv_layout)


LAYOUTS = [
    SparseLayout("v32", tp=2),
    SparseLayout("v32", tp=2, dcp=2, interleave=1),
    SparseLayout("glm5", tp=2, dcp=2, interleave=4),
    SparseLayout("v32", pcp=2, interleave=1),
    SparseLayout("glm5", pcp=2, strategy="ring", kv_layout="replicated"),
    SparseLayout("v32", tp=2, pcp=2, interleave=4, strategy="pass-q"),
    SparseLayout("glm5", tp=2, pcp=2, dcp=2, interleave=2, strategy="ring"),
]
"""TP=2 (every rank holds every latent and index key); TP=2 x DCP=2 with each token on one rank in turn
(interleave 1) and with whole blocks in turn (interleave = block size); PCP=2 sharded (each query's top-k over
index keys split across both PCP ranks: queries gathered over PCP), PCP=2 replicated (each PCP rank holds the
whole prefix; decode rows split over PCP, their rows synced to the other copy), TP=2 x PCP=2 sharded at the
block size, TP=2 x PCP=2 x DCP=2 sharded at interleave 2 (four ranks, each holding every fourth pair of positions:
rows gathered over PCP, heads over DCP); one prefill strategy each (the layer moves its own rows by all-gather
under all of them)."""


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
            self._folders[case] = save_tiny_sparse(str(self._tmp.mktemp(case)), case, seed=MODEL_SEED)
        return self._folders[case]

    def reference(self, case: str) -> dict:
        if case not in self._references:
            with LLM(self.folder(case), **COMMON) as llm:
                self._references[case] = generate_counted(llm, workload_prompts(1),
                                                          greedy_params(MAX_TOKENS, prompt_logprobs=True), "ref")
        return self._references[case]

    def _launch(self, layout: SparseLayout) -> Run:
        prompts = workload_prompts(1)
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


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", LAYOUTS, ids=SparseLayout.label)
def test_layout_matches_single_rank(launches, layout):
    reference = launches.reference(layout.case)
    run = launches.run(layout)
    for name, output in run.first.items():
        assert_same_greedy(output, reference[name], what=f"{layout.label()} pass 1 {name}", prompt_logprobs=True)
    for name, output in run.second.items():
        assert_same_greedy(output, reference[name], what=f"{layout.label()} pass 2 {name}", prompt_logprobs=False)
    assert run.prefix_hits > 0, "pass 2 repeats pass 1's prompts and should hit the prefix cache"
    # a latent pool and an index pool per layer, [blocks x block_size, 1, 48] and [.., 1, 32] float32
    assert run.kv_bytes == NUM_LAYERS * run.num_blocks * BLOCK_SIZE * ROW_VALUES * FLOAT32
