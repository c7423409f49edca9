"""The gated-DeltaNet hybrids (Qwen3.5 dense, Qwen3.5-MoE, Qwen3-Next) on the single-rank engine against
transformers on the same tiny random weights (tests/tiny_hybrid.py). Greedy tokens identical, prompt and
sampled-token logprobs within 1e-4 in float32.

Each family: a batch of prompts of mixed lengths (1 token to two delta-rule blocks) with prompt logprobs; a run
with a small chunked-prefill budget, so chunks continue from the saved convolution window and delta-rule state and
decode steps batch single tokens next to prompt chunks; and a KV cache too small for the batch, so requests are
preempted, give back their state slots and are recomputed from a zero state. Then the per-request state's
accounting (spec, admission, capacity log) and the options refused for hybrids.
"""

from __future__ import annotations

import random

import pytest

from cpllm import LLM, SamplingParams
from cpllm.config.engine import CacheConfig, EngineConfig, ParallelConfig
from cpllm.config.speculative import SpeculativeConfig
from cpllm.engine.kv_blocks import BlockPool
from cpllm.engine.request import Request, RequestStatus
from cpllm.engine.scheduler import Scheduler
from cpllm.config.engine import SchedulerConfig
from cpllm.layers.registry import state_layer_indices, state_layer_specs
from cpllm.model.loaders.safetensors_source import read_hf_config
from reference import check_against_hf, hf_greedy
from tiny_hybrid import CASES, make_tiny_hybrid, save_tiny_hybrid

MAX_TOKENS = 8
PROMPT_LENGTHS = (1, 5, 23, 40, 90)
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2, prompt_logprobs=2)
LAYER_STATE_BYTES = (128 * 3 + 4 * 16 * 16) * 4
"""One DeltaNet layer's state of one request: 128 conv channels x 3 taps, 4 value heads x 16 x 16, float32."""


def random_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module", params=sorted(CASES))
def tiny(request, tmp_path_factory):
    folder = save_tiny_hybrid(str(tmp_path_factory.mktemp(request.param)), request.param, seed=1)
    hf = make_tiny_hybrid(request.param, seed=1)
    prompts = random_prompts(hf.config.vocab_size)
    return request.param, folder, prompts, [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]


def test_config_reads_each_family(tiny):
    name, folder, _, _ = tiny
    config = read_hf_config(folder)
    linear = config.linear_attention
    assert linear.linear_layers == (0, 1, 2, 4, 5, 6)  # layers 3 and 7 full attention
    assert (linear.rotary_dim, linear.conv_dim, linear.fused_projections) == (8, 128, name == "qwen3_next")
    assert (config.moe is not None) == (name != "qwen3_5")
    assert state_layer_indices(config) == frozenset(linear.linear_layers)
    specs = state_layer_specs(config, tp_size=1)
    assert {spec.bytes_per_request for spec in specs.values()} == {LAYER_STATE_BYTES}
    assert {spec.bytes_per_token for spec in specs.values()} == {0}
    assert state_layer_specs(config, tp_size=2)[0].bytes_per_request == LAYER_STATE_BYTES // 2


def test_batch_matches_transformers(tiny):
    _, folder, prompts, refs = tiny
    with LLM(folder, max_model_len=256, block_size=4, quantization="none", enable_prefix_caching=False) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    for output, ref in zip(outputs, refs):
        assert len(output.outputs[0].token_ids) == MAX_TOKENS
        check_against_hf(output, *ref)


def test_chunked_prefill_continues_the_state(tiny):
    _, folder, prompts, refs = tiny
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    with LLM(folder, max_model_len=256, block_size=4, quantization="none", enable_prefix_caching=False,
             max_num_batched_tokens=7) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for output, ref in zip(outputs, refs):
        check_against_hf(output, ref[0], ref[1])


def test_preemption_recomputes_the_state(tiny):
    """The K/V pools hold the longest request alone: requests are preempted, their state slots freed and taken
    again, and recomputed from a zero state; outputs unchanged."""
    _, folder, prompts, refs = tiny
    prompts, refs = prompts[:4], refs[:4]
    # 2 full layers x (K + V) x 2 heads x 16 x 4 bytes x 4 tokens = 2,048 bytes per block; 12 blocks = 48 tokens,
    # the 40-token prompt and its 8 tokens, where the four need 25 blocks together; the four states of the 6
    # DeltaNet layers come out of the budget first
    budget = 4 * 6 * LAYER_STATE_BYTES + 12 * 2048
    with LLM(folder, max_model_len=48, block_size=4, quantization="none", enable_prefix_caching=False,
             max_num_seqs=4, kv_cache_memory_bytes=budget) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
        assert llm.engine.executor.rank_info.kv.num_blocks == 12
        assert llm.engine.scheduler.num_preemptions > 0
        assert sorted(llm.engine.scheduler.free_state_slots) == [0, 1, 2, 3]  # every slot back
    for output, ref in zip(outputs, refs):
        check_against_hf(output, *ref)


def test_state_slots_at_admission():
    """A slot per running request, taken at admission and given back at finish and at preemption; no request is
    admitted without one."""
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    scheduler = Scheduler(config, BlockPool(64, enable_prefix_caching=False), 4, state_slots=2)
    for i in range(3):
        scheduler.add_request(Request(request_id=f"r{i}", prompt_token_ids=[5] * 6, sampling_params=SamplingParams()))
    step = scheduler.schedule()
    assert [(c.request_id, c.state_slot) for c in step.chunks] == [("r0", 0), ("r1", 1)]  # r2 waits for a slot
    scheduler.finish(scheduler.requests["r0"], RequestStatus.FINISHED_STOPPED)
    scheduler.on_step_done(step)
    step = scheduler.schedule()
    assert {c.request_id: c.state_slot for c in step.chunks} == {"r1": 1, "r2": 0}
    scheduler._preempt(scheduler.requests["r2"])
    assert scheduler.free_state_slots == [0]


def test_capacity_log_counts_the_state(tiny, caplog):
    _, folder, _, _ = tiny
    with caplog.at_level("INFO"):
        with LLM(folder, max_model_len=64, block_size=4, quantization="none", enable_prefix_caching=False):
            pass
    lines = [r.getMessage() for r in caplog.records]
    assert any("layers 3, 7 (2): full attention" in line for line in lines), lines
    assert any(f"layers 0-2, 4-6 (6): recurrent state (conv 128x3 + delta 4x256 values per request, "
               f"{LAYER_STATE_BYTES} bytes)" in line for line in lines), lines


def test_refused_options(tiny):
    _, folder, _, _ = tiny
    model = read_hf_config(folder)
    short = SchedulerConfig(max_model_len=256)
    plain = dict(model_path=folder, model=model, cache=CacheConfig(enable_prefix_caching=False), scheduler=short)
    EngineConfig(**plain)  # accepted
    assert EngineConfig(model_path=folder, model=model, scheduler=short).cache.enable_prefix_caching is False
    # prefix hits start from state snapshots, asked for (tests/test_qwen3_5_prefix_spec.py)
    EngineConfig(model_path=folder, model=model, cache=CacheConfig(enable_prefix_caching=True), scheduler=short)
    EngineConfig(**plain, parallel=ParallelConfig(prefill_context_parallel_size=2))  # the state scan runs it
    EngineConfig(**plain, speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=2))
    with pytest.raises(ValueError, match="speculative_config"):  # but not under PCP
        EngineConfig(**plain, speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=2),
                     parallel=ParallelConfig(prefill_context_parallel_size=2))
    with pytest.raises(ValueError, match="compile_decode"):
        EngineConfig(**plain, compile_decode=True)
