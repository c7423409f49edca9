"""Windowed layers hold only their window: the engine with KV groups against transformers and across ranks.

- A tiny Mistral (every layer slides, window 10) with a pool of 48 tokens serves a 192-token prompt (4x what
  full attention could hold), exactly as transformers computes it, with every request's blocks within its window
  plus one block between steps (the engine's own accounting), and again from the prefix cache.
- A tiny Qwen2 (layer 0 full, layers 1-2 sliding, window 8): the windowed layers take only what their windows
  need, so the full layer alone sets max_model_len, above what full attention in every layer would allow.
- PCP = 2 (sharded layout, interleave 2) with the same small pool per rank against the single-rank engine: each
  rank frees its share of the slid-out blocks (the block ids are the replica's).
"""

from __future__ import annotations

import pytest

from cpllm import LLM, SamplingParams
from cpllm.kv_groups import window_blocks
from parallel_helpers import assert_same_greedy, generate_counted, random_prompt
from reference import check_against_hf, hf_greedy
from tiny_window_models import make_tiny_window_model, save_tiny_window_model

WINDOW = 10
BLOCK_SIZE = 4
LAYER_BLOCK_BYTES = 2 * BLOCK_SIZE * 2 * 16 * 4  # K and V x tokens x 2 KV heads x head_dim 16 x float32
POOL_BLOCKS = 12  # 48 tokens on one rank
LONG = 4 * POOL_BLOCKS * BLOCK_SIZE
MAX_TOKENS = 16
BUDGET = 16
PARAMS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1, prompt_logprobs=1)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    folder = save_tiny_window_model(str(tmp_path_factory.mktemp("mistral")), "mistral", seed=1,
                                    sliding_window=WINDOW)
    hf = make_tiny_window_model("mistral", seed=1, sliding_window=WINDOW)
    prompt = random_prompt(LONG, seed=7)
    return folder, prompt, hf_greedy(hf, prompt, MAX_TOKENS)


def run_steps(llm, prompt, params, tag, tokens_per_block, window=WINDOW):
    """The prompt through the engine's step loop; asserts after every step that each request holds at most its
    window plus one block in the windowed group. Returns the final output."""
    engine = llm.engine
    engine.add_request(tag, prompt, params)
    limit = window_blocks(window, tokens_per_block)
    final = None
    for _ in range(10 * (len(prompt) + MAX_TOKENS)):
        if not engine.has_unfinished_requests():
            break
        for output in engine.step():
            final = output if output.finished else final
        for rid in engine.scheduler.requests:
            assert engine.scheduler.request_blocks(rid)[0] <= limit
    assert final is not None and final.finished
    return final


def test_all_windowed_model_serves_a_prompt_four_times_its_pool(mistral):
    folder, prompt, ref = mistral
    with LLM(folder, max_model_len=256, block_size=BLOCK_SIZE, max_num_batched_tokens=BUDGET,
             kv_cache_memory_bytes=POOL_BLOCKS * 2 * LAYER_BLOCK_BYTES) as llm:
        engine = llm.engine
        assert engine.executor.rank_info.kv.group_blocks == (POOL_BLOCKS,)
        assert engine.kv_capacity_tokens == LONG // 4 and engine.max_model_len == 256  # not bounded by the pool
        first = run_steps(llm, prompt, PARAMS, "first", BLOCK_SIZE)
        check_against_hf(first, *ref)
        # during a step a request also holds its chunk's blocks, never more
        peak = engine.scheduler_totals.peak_request_blocks
        assert peak[0] <= window_blocks(WINDOW, BLOCK_SIZE, BUDGET) < POOL_BLOCKS
        again = run_steps(llm, prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                                      logprobs=1), "again", BLOCK_SIZE)
        assert engine.scheduler.num_prefix_hit_tokens > LONG // 2  # the window's last blocks were still cached
        check_against_hf(again, ref[0], ref[1])
        assert engine.pool.num_free == POOL_BLOCKS


def test_hybrid_capacity_is_set_by_the_full_layers(tmp_path):
    folder = save_tiny_window_model(str(tmp_path / "qwen2"), "qwen2", seed=1)  # layer 0 full, 1-2 window 8
    hf = make_tiny_window_model("qwen2", seed=1)
    even = 20  # blocks per layer the budget would give if every layer kept every block: 80 tokens
    with LLM(folder, max_model_len=256, block_size=BLOCK_SIZE, max_num_batched_tokens=BUDGET, max_num_seqs=2,
             kv_cache_memory_bytes=even * 3 * LAYER_BLOCK_BYTES) as llm:
        engine = llm.engine
        window_need = 2 * (window_blocks(8, BLOCK_SIZE) + 1) + BUDGET // BLOCK_SIZE  # 2 windows + a chunk
        full = even * 3 - 2 * window_need  # the windowed layers' spare memory goes to the full one
        assert engine.executor.rank_info.kv.group_blocks == (full, window_need)
        assert engine.max_model_len == full * BLOCK_SIZE > even * BLOCK_SIZE
        prompt = random_prompt(full * BLOCK_SIZE - MAX_TOKENS, seed=3)  # fits only thanks to the windows' share
        (output,) = llm.generate([{"prompt_token_ids": prompt}], PARAMS)
        check_against_hf(output, *hf_greedy(hf, prompt, MAX_TOKENS))
        peak = engine.scheduler_totals.peak_request_blocks
        assert peak[0] == full and peak[1] <= window_blocks(8, BLOCK_SIZE, BUDGET)
        with pytest.raises(ValueError, match=f"exceeds max_model_len={full * BLOCK_SIZE}"):
            engine.check_prompt(prompt + [5], SamplingParams(max_tokens=MAX_TOKENS))


def test_window_smaller_than_its_pool_needs_is_refused(mistral):
    folder, _, _ = mistral
    need = window_blocks(WINDOW, BLOCK_SIZE)
    with pytest.raises(ValueError, match=f"holds {need - 1} blocks of {BLOCK_SIZE} tokens; one request's window "
                                         f"of {WINDOW} tokens needs {need}"):
        LLM(folder, max_model_len=256, block_size=BLOCK_SIZE, kv_cache_memory_bytes=(need - 1) * 2 * LAYER_BLOCK_BYTES)


@pytest.mark.timeout(300)
def test_sharded_pcp2_frees_each_ranks_share_like_one_rank(mistral):
    folder, prompt, ref = mistral
    # per rank: 6 blocks of 4 tokens; a virtual block is 8 tokens over both ranks, so the group holds 48 tokens
    options = dict(max_model_len=256, block_size=BLOCK_SIZE, max_num_batched_tokens=9, threads_per_rank=1,
                   distributed_timeout=60, prefill_context_parallel_size=2, cp_kv_cache_interleave_size=2,
                   cp_prefill_strategy="ring", kv_cache_memory_bytes=6 * 2 * LAYER_BLOCK_BYTES)
    with LLM(folder, **options) as llm:
        engine = llm.engine
        assert engine.kv_capacity_tokens == LONG // 4 and engine.tokens_per_block == 2 * BLOCK_SIZE
        output = run_steps(llm, prompt, PARAMS, "pcp2", 2 * BLOCK_SIZE)
        assert engine.scheduler_totals.peak_request_blocks[0] <= window_blocks(WINDOW, 2 * BLOCK_SIZE, 9)
    with LLM(folder, max_model_len=256, block_size=BLOCK_SIZE, max_num_batched_tokens=9,
             kv_cache_memory_bytes=POOL_BLOCKS * 2 * LAYER_BLOCK_BYTES) as llm:
        single = run_steps(llm, prompt, PARAMS, "one", BLOCK_SIZE)
    check_against_hf(single, *ref)
    assert_same_greedy(output, single, what="PCP=2 sharded, window 10", prompt_logprobs=True)


@pytest.mark.timeout(300)
def test_hybrid_replicated_pcp2_syncs_each_groups_pools(tmp_path):
    """Qwen2 (a full layer and two windowed ones, two KV groups) under PCP = 2 with the replicated layout: decode-only
    steps split their tokens over the PCP copies, and each group's K/V reach the other copy at that group's slots."""
    folder = save_tiny_window_model(str(tmp_path / "qwen2"), "qwen2", seed=1)
    prompts = {f"len{n}": random_prompt(n, seed=n) for n in (5, 37, 60)}
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    common = dict(max_model_len=256, block_size=BLOCK_SIZE, max_num_batched_tokens=9, max_num_seqs=4,
                  kv_cache_memory_bytes=40 * 3 * LAYER_BLOCK_BYTES)
    with LLM(folder, **common) as llm:
        single = generate_counted(llm, prompts, params, "one")
    with LLM(folder, **common, threads_per_rank=1, distributed_timeout=60, prefill_context_parallel_size=2,
             cp_kv_cache_layout="replicated", cp_prefill_strategy="ring") as llm:
        groups = llm.engine.executor.rank_info.kv.group_blocks
        assert len(groups) == 2 and groups[1] < groups[0]
        replicated = generate_counted(llm, prompts, params, "repl")
        assert llm.engine.scheduler_totals.peak_request_blocks[1] <= window_blocks(8, BLOCK_SIZE, 9)
    for name in prompts:
        assert_same_greedy(replicated[name], single[name], what=f"replicated PCP=2 {name}", prompt_logprobs=True)


@pytest.mark.timeout(300)
def test_window_shorter_than_the_interleave_span(tmp_path):
    """W = 5 under PCP = 2 with interleave 4 (a cycle of 8 positions): a decode's window often lies on one rank
    alone, the other's shard holds none of it; freeing whole virtual blocks of 8 stays exact."""
    folder = save_tiny_window_model(str(tmp_path / "mistral5"), "mistral", seed=3, sliding_window=5)
    hf = make_tiny_window_model("mistral", seed=3, sliding_window=5)
    prompt = random_prompt(60, seed=11)
    with LLM(folder, max_model_len=256, block_size=BLOCK_SIZE, max_num_batched_tokens=9, threads_per_rank=1,
             distributed_timeout=60, prefill_context_parallel_size=2, cp_kv_cache_interleave_size=4,
             kv_cache_memory_bytes=4 * 2 * LAYER_BLOCK_BYTES) as llm:
        assert llm.engine.kv_capacity_tokens == 32 < len(prompt)
        output = run_steps(llm, prompt, PARAMS, "w5", 2 * BLOCK_SIZE, window=5)
    check_against_hf(output, *hf_greedy(hf, prompt, MAX_TOKENS))
