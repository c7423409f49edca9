"""--kv-cache-dtype: K/V stored in bfloat16 / float16 under a float32 model.

- Capacity: the same kv_cache_memory_bytes holds twice the blocks, and the pools have the asked dtype.
- Accuracy: against float32 K/V on the same tiny model, greedy tokens identical and logprobs within 0.02 (measured
  2.5e-3 for bfloat16, 3.3e-4 for float16 on the shared workload).
- Exactness of the layouts: every layout rounds each K/V value once, the same way, so a layout with bfloat16 K/V
  equals the single rank with bfloat16 K/V within the suite's 1e-4 (chunked prefill, prefix hits and decode; the
  sharded layout with TP x PCP x DCP and pass-Q, and the replicated layout with its K/V sync, which moves bfloat16
  rows over gloo).
"""

from __future__ import annotations

import pytest

from cpllm import LLM
from parallel_helpers import (
    BLOCK_SIZE,
    MAX_MODEL_LEN,
    MAX_NUM_BATCHED_TOKENS,
    LaunchCache,
    Layout,
    assert_same_greedy,
    generate_counted,
    greedy_params,
    max_abs_diff,
    prompt_logprob_values,
    sampled_logprobs,
    workload_prompts,
)

COMMON = dict(max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
              distributed_timeout=60, kv_cache_memory_bytes=2**20)
MAX_TOKENS = 8
LAYOUTS = {  # layout -> (model, kv cache layout)
    Layout(tp=2, pcp=2, dcp=2, interleave=2, strategy="pass-q", max_tokens=MAX_TOKENS): ("kv1", "sharded"),
    Layout(tp=1, pcp=2, dcp=1, interleave=1, strategy="ring", max_tokens=MAX_TOKENS): ("kv2", "replicated"),
}


class Launches(LaunchCache):
    def reference(self, key: tuple[str, str]) -> dict:
        """(model, kv_cache_dtype) -> name -> output of the single-rank engine, two passes (the second hits the
        prefix cache)."""
        if key not in self._references:
            model, kv_dtype = key
            self._references[key] = self._generate(self.folder(model), kv_cache_dtype=kv_dtype)
        return self._references[key]

    def _launch(self, layout: Layout) -> dict:
        model, kv_layout = LAYOUTS[layout]
        return self._generate(self.folder(model), kv_cache_dtype="bfloat16", cp_kv_cache_layout=kv_layout,
                              **layout.engine_options())

    @staticmethod
    def _generate(folder: str, **options) -> dict:
        with LLM(folder, threads_per_rank=1, **COMMON, **options) as llm:
            prompts = workload_prompts(2)
            first = generate_counted(llm, prompts, greedy_params(MAX_TOKENS, prompt_logprobs=True), "p1")
            second = generate_counted(llm, prompts, greedy_params(MAX_TOKENS, prompt_logprobs=False), "p2")
            one_rank = options.get("tensor_parallel_size", 1) == 1 and \
                options.get("prefill_context_parallel_size", 1) == 1
            return {"first": first, "second": second, "capacity": llm.engine.kv_capacity_tokens,
                    "pool_dtype": llm.engine.executor.rank_info.kv.dtype if one_rank else None}


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> Launches:
    return Launches(tmp_path_factory)


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float16"])
def test_narrow_kv_cache_holds_twice_the_tokens_and_stays_close(launches, kv_dtype):
    full, narrow = launches.reference(("kv2", "auto")), launches.reference(("kv2", kv_dtype))
    assert full["pool_dtype"] == "float32" and narrow["pool_dtype"] == kv_dtype
    assert narrow["capacity"] == 2 * full["capacity"]
    for name, output in narrow["first"].items():
        want = full["first"][name]
        assert output.outputs[0].token_ids == want.outputs[0].token_ids, name
        assert max_abs_diff(sampled_logprobs(output), sampled_logprobs(want)) < 0.02, name
        assert max_abs_diff(prompt_logprob_values(output), prompt_logprob_values(want)) < 0.02, name


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", list(LAYOUTS), ids=Layout.label)
def test_layouts_with_bfloat16_kv_match_the_single_rank(launches, layout):
    model, kv_layout = LAYOUTS[layout]
    reference, run = launches.reference((model, "bfloat16")), launches.run(layout)
    for name, output in run["first"].items():
        assert_same_greedy(output, reference["first"][name], what=f"{layout.label()} {kv_layout} {name}",
                           prompt_logprobs=True)
    for name, output in run["second"].items():
        assert_same_greedy(output, reference["second"][name], what=f"{layout.label()} {kv_layout} pass 2 {name}",
                           prompt_logprobs=False)
