"""Prefix caching and speculative decoding on the gated-DeltaNet hybrids (tiny random Qwen3.5 / Qwen3-Next,
tests/tiny_hybrid.py), each against the same engine without it.

Prefix caching: a hit starts from a state snapshot taken where a chunk ended at a block boundary
(cpllm/engine/state_snapshots.py): prompts sharing prefixes, run one at a time and again, give the tokens of a run
without the cache and logprobs within 1e-4, on one rank and under PCP = 2; a KV cache too small for the batch
preempts requests, which then resume from their snapshots. The scheduler's snapshot points (where the cached blocks
outrun the snapshots, the prompt's last boundary) and the capacity log's line are checked on their own.

Speculative decoding: a verify chunk's states go through its known tokens only, and the drafts accepted last step
are computed again before the new drafts (cpllm/engine/scheduler.py `_drafts`), so greedy output is token for token
the run without speculation, with prompt lookup and with a draft model (a tiny Llama following the same successor
map as the hybrid, so that drafts are accepted), on one rank and under TP = 2.
"""

from __future__ import annotations

import random

import pytest
import torch

from cpllm import LLM, SamplingParams
from cpllm.config.engine import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from cpllm.config.speculative import SpeculativeConfig
from cpllm.engine.kv_blocks import BlockPool
from cpllm.engine.request import Request
from cpllm.engine.scheduler import Scheduler
from cpllm.engine.state_snapshots import StateSnapshots
from cpllm.model.loaders.safetensors_source import read_hf_config
from spec_decode_helpers import save_cycle_model, successor_map, walk
from tiny_hybrid import make_tiny_hybrid, save_tiny_hybrid
from tiny_models import tiny_hf_tokenizer

LAYER_STATE_BYTES = (128 * 3 + 4 * 16 * 16) * 4
"""One DeltaNet layer's state of one request (tests/test_qwen3_5_vs_hf.py)."""
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
PCP_OPTIONS = dict(distributed_timeout=60)


def shared_prompts(seed: int = 0) -> list[list[int]]:
    """Prompts sharing a 37-token prefix (a branch at block 9 of 4 tokens), one equal to it, one a shorter prefix
    of it; each twice, so the second round hits the snapshots the first took."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 300) for _ in range(37)]
    prompts = [shared + [rng.randrange(3, 300) for _ in range(n)] for n in (5, 11, 0)] + [shared[:20]]
    return prompts + prompts


def run_one_by_one(folder: str, prompts, **options) -> tuple[list, LLM]:
    outputs = []
    with LLM(folder, max_model_len=128, block_size=4, quantization="none", **options) as llm:
        for prompt in prompts:
            outputs.append(llm.generate([{"prompt_token_ids": prompt}], PARAMS)[0])
        scheduler = llm.engine.scheduler
        counts = dict(hit_tokens=scheduler.num_prefix_hit_tokens,
                      saved=scheduler.snapshots.num_saved if scheduler.snapshots else 0,
                      restored=scheduler.snapshots.num_restored if scheduler.snapshots else 0)
    return outputs, counts


def assert_same(outputs, expected) -> None:
    for got, want in zip(outputs, expected, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        for a, b in zip(got.outputs[0].logprobs, want.outputs[0].logprobs, strict=True):
            token = next(iter(b))
            assert abs(a[token].logprob - b[token].logprob) < 1e-4


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return {family: save_tiny_hybrid(str(tmp_path_factory.mktemp(family)), family, seed=1)
            for family in ("qwen3_5", "qwen3_next")}


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_prefix_hits_match_no_cache(folders, family):
    prompts = shared_prompts()
    expected, _ = run_one_by_one(folders[family], prompts, enable_prefix_caching=False)
    outputs, counts = run_one_by_one(folders[family], prompts, enable_prefix_caching=True)
    assert_same(outputs, expected)
    # the third prompt (the shared prefix) resumes at 36 from the snapshot the second took at its branch point;
    # the second round resumes every prompt at its last boundary
    assert [o.num_cached_tokens for o in outputs] == [0, 0, 36, 0, 40, 44, 36, 16]
    assert counts == dict(hit_tokens=172, saved=4, restored=5)


def test_one_snapshot_slot_keeps_fewer_hits_and_the_same_output(folders):
    """--state-snapshots 1: one slot, so each snapshot replaces the one before (a prompt takes one at its branch
    point, then one at its last boundary): only the first prompt of the second round resumes, at 16 from the
    snapshot the shorter prefix took last; output unchanged."""
    prompts = shared_prompts()
    expected, _ = run_one_by_one(folders["qwen3_5"], prompts, enable_prefix_caching=False)
    outputs, counts = run_one_by_one(folders["qwen3_5"], prompts, enable_prefix_caching=True, state_snapshots=1)
    assert_same(outputs, expected)
    assert [o.num_cached_tokens for o in outputs] == [0, 0, 0, 0, 16, 0, 0, 0]
    assert counts == dict(hit_tokens=16, saved=9, restored=1)


def test_state_snapshots_is_refused_where_it_means_nothing(folders):
    folder = folders["qwen3_5"]
    base = dict(model_path=folder, model=read_hf_config(folder), scheduler=SchedulerConfig(max_model_len=128))
    with pytest.raises(ValueError, match="state_snapshots must be an integer >= 1"):
        CacheConfig(enable_prefix_caching=True, state_snapshots=0)
    with pytest.raises(ValueError, match="state_snapshots=2 applies .* prefix caching off"):
        EngineConfig(**base, cache=CacheConfig(enable_prefix_caching=False, state_snapshots=2))
    EngineConfig(**base, cache=CacheConfig(enable_prefix_caching=True, state_snapshots=2))  # accepted


def test_prefix_hits_under_pcp2(folders):
    prompts = shared_prompts()[:3] + shared_prompts()[4:7]
    expected, _ = run_one_by_one(folders["qwen3_5"], prompts, enable_prefix_caching=False)
    outputs, counts = run_one_by_one(folders["qwen3_5"], prompts, enable_prefix_caching=True,
                                     prefill_context_parallel_size=2, **PCP_OPTIONS)
    assert_same(outputs, expected)
    assert counts["restored"] == 4 and counts["hit_tokens"] > 0


def test_preempted_requests_resume_from_snapshots(folders):
    """The K/V pools hold the longest request alone: requests are preempted and recomputed, from their own
    snapshots where they took one; outputs unchanged."""
    prompts = shared_prompts()[:4]
    # 2 full layers x (K + V) x 2 heads x 16 x 4 bytes x 4 tokens = 2,048 bytes per block; 14 blocks; the live
    # states and as many snapshots (4 + 4 slots of the 6 DeltaNet layers) come out of the budget first
    budget = 8 * 6 * LAYER_STATE_BYTES + 14 * 2048
    options = dict(max_model_len=56, block_size=4, quantization="none", max_num_seqs=4, kv_cache_memory_bytes=budget)
    with LLM(folders["qwen3_5"], enable_prefix_caching=False, **options) as llm:
        expected = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)
    with LLM(folders["qwen3_5"], enable_prefix_caching=True, **options) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)
        assert llm.engine.executor.rank_info.kv.num_blocks == 14
        assert llm.engine.scheduler.num_preemptions > 0
        assert sorted(llm.engine.scheduler.free_state_slots) == [0, 1, 2, 3]
    assert_same(outputs, expected)


def test_snapshot_points_and_lru():
    """A prompt's chunk ends at its last block boundary before its last token and saves there; a later prompt
    whose cached blocks go past the last snapshot ends its first chunk at that point; the least recently used
    snapshot is reused first."""
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64)
    scheduler = Scheduler(config, BlockPool(64, enable_prefix_caching=True), 4, state_slots=2, state_snapshots=2)

    def run(request_id, tokens):
        scheduler.add_request(Request(request_id=request_id, prompt_token_ids=tokens, sampling_params=PARAMS))
        chunks = []
        while True:
            step = scheduler.schedule()
            chunks += [(c.start_pos, c.end_pos, c.state_restore, c.state_save) for c in step.chunks]
            scheduler.on_step_done(step)
            request = scheduler.requests[request_id]
            if request.num_computed_tokens == request.num_tokens:
                scheduler.finish(request, request.status)
                return chunks

    a = list(range(3, 13))  # 10 tokens: boundaries 4 and 8
    assert run("a", a) == [(0, 8, -1, 2), (8, 10, -1, -1)]  # saved at 8 into snapshot slot 2
    assert run("a2", a) == [(8, 10, 2, -1)]  # a hit of 8 tokens, from slot 2
    b = a[:8] + [40, 41, 42]  # shares 8 tokens: a hit from slot 2, its own last boundary is 8 too
    assert run("b", b) == [(8, 11, 2, -1)]
    c = a[:4] + [50] * 6  # shares block 0 only: no snapshot there, so its first chunk ends at 4 and saves
    assert run("c", c) == [(0, 4, -1, 3), (4, 8, -1, 2), (8, 10, -1, -1)]
    assert len(scheduler.snapshots) == 2  # slot 2 (the least recently used) now holds c's boundary at 8
    assert run("a3", a) == [(4, 8, 3, 2), (8, 10, -1, -1)]  # a's 8 is gone: from 4 (slot 3), saving again


def test_snapshot_registry():
    snapshots = StateSnapshots(first_slot=4, count=2)
    first, second = snapshots.take(), snapshots.take()
    snapshots.register(first, b"x")
    snapshots.register(second, b"y")
    assert (snapshots.find(b"x"), snapshots.find(b"y"), snapshots.find(b"z")) == (4, 5, None)
    snapshots.find(b"x")  # y is now the least recently used
    assert snapshots.take() == 5 and not snapshots.holds(b"y") and snapshots.holds(b"x")


def test_capacity_log_counts_the_snapshots(folders, caplog):
    with caplog.at_level("INFO"):
        with LLM(folders["qwen3_5"], max_model_len=64, block_size=4, quantization="none", max_num_seqs=3,
                 enable_prefix_caching=True):
            pass
    per_request = 6 * LAYER_STATE_BYTES
    line = (f"state snapshots for prefix hits: 3 slots x {per_request / 2**10:.1f} KiB per rank "
            f"({3 * per_request / 2**20:.2f} MiB, out of the KV budget)")
    assert any(r.getMessage().startswith(line) for r in caplog.records), [r.getMessage() for r in caplog.records]
    caplog.clear()
    with caplog.at_level("INFO"):
        with LLM(folders["qwen3_5"], max_model_len=64, block_size=4, quantization="none", max_num_seqs=3,
                 enable_prefix_caching=True, state_snapshots=1):
            pass
    line = f"state snapshots for prefix hits: 1 slots x {per_request / 2**10:.1f} KiB per rank"
    assert any(r.getMessage().startswith(line) for r in caplog.records), [r.getMessage() for r in caplog.records]


def save_cycle_hybrid(folder: str, family: str, seed: int) -> tuple[str, dict[int, int]]:
    """The tiny hybrid with its LM head set so greedy decoding mostly follows the successor map of
    tests/spec_decode_helpers.py (as its cycle Llama does), so prompt lookup and a cycle Llama draft well."""
    model = make_tiny_hybrid(family, seed=seed)
    successor = successor_map(model.config.vocab_size, seed)
    with torch.no_grad():
        embed = model.model.embed_tokens.weight
        head = torch.zeros_like(model.lm_head.weight)
        for token, nxt in successor.items():
            head[nxt] = embed[token] * 2.0
        model.lm_head.weight.copy_(head)
    model.save_pretrained(folder)
    tiny_hf_tokenizer().save_pretrained(folder)
    return folder, successor


@pytest.fixture(scope="module")
def cycle(tmp_path_factory):
    hybrid, successor = save_cycle_hybrid(str(tmp_path_factory.mktemp("cycle_hybrid")), "qwen3_5", seed=1)
    draft, _ = save_cycle_model(str(tmp_path_factory.mktemp("cycle_llama")), seed=1, scale=2.0)
    rng = random.Random(0)
    prompts = [walk(successor, start, 12) for start in (10, 50, 90)] + [[rng.randrange(3, 300) for _ in range(20)]]
    return hybrid, draft, prompts


SPECS = {
    "ngram": dict(method="ngram", num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1),
    "draft_model": dict(num_speculative_tokens=3, draft_length="fixed"),
}


@pytest.mark.parametrize("layout", ["one", "tp2"])
@pytest.mark.parametrize("method", sorted(SPECS))
def test_spec_decoding_is_greedy_identical(cycle, method, layout):
    hybrid, draft, prompts = cycle
    spec = dict(SPECS[method], **({"model": draft} if method == "draft_model" else {}))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    options = dict(max_model_len=128, block_size=4, quantization="none")
    if layout == "tp2":
        options.update(tensor_parallel_size=2, **PCP_OPTIONS)
    with LLM(hybrid, **options) as llm:
        expected = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    with LLM(hybrid, speculative_config=spec, **options) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        totals = llm.engine.spec_decode_totals
    assert_same(outputs, expected)
    assert totals.num_accepted_tokens > 0  # accepted drafts were computed again from the kept state


def test_spec_refused_under_pcp_and_with_a_state_draft(folders):
    folder = folders["qwen3_5"]
    plain = dict(model_path=folder, model=read_hf_config(folder), scheduler=SchedulerConfig(max_model_len=128),
                 cache=CacheConfig(enable_prefix_caching=False))
    ngram = SpeculativeConfig(method="ngram", num_speculative_tokens=2)
    EngineConfig(**plain, speculative_config=ngram)  # accepted on one rank
    with pytest.raises(ValueError, match="prefill_context_parallel_size=2"):
        EngineConfig(**plain, speculative_config=ngram, parallel=ParallelConfig(prefill_context_parallel_size=2))
    with pytest.raises(ValueError, match="draft model with state layers"):
        LLM(folder, max_model_len=128, quantization="none", speculative_config={"model": folder,
                                                                                "num_speculative_tokens": 2})
