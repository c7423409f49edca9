"""KV cache groups on the scheduler alone (no torch, no model): which blocks a sliding-window group frees and when,
their reuse, the per-request bound, chunks capped by a small pool, several windows, the prefix-hit rule, and how
the groups divide the memory. The engine against transformers and a sharded layout: test_kv_groups_engine.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cpllm.config.engine import ModelConfig, SchedulerConfig
from cpllm.engine.kv_blocks import BlockPool
from cpllm.engine.request import Request, RequestStatus
from cpllm.engine.sampling_params import SamplingParams
from cpllm.engine.scheduler import Scheduler
from cpllm.kv_groups import (
    FREED_BLOCK,
    KVGroupSpec,
    blocks_touched,
    first_kept_block,
    group_block_needs,
    kv_groups,
    layer_groups,
    length_capacity,
    max_chunk,
    split_blocks,
    window_blocks,
)

V = 4  # tokens per virtual block
FULL = KVGroupSpec(window=None, layers=(0,))


def windowed(window: int, *layers: int) -> KVGroupSpec:
    return KVGroupSpec(window=window, layers=layers or (1,))


def make(groups, blocks, *, budget=16, max_seqs=8, caching=True, max_len=4096):
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, max_model_len=max_len)
    pools = [BlockPool(n, caching) for n in blocks]
    return Scheduler(config, pools, V, tuple(groups)), pools


def request(rid, n, start=10, max_tokens=8):
    return Request(request_id=rid, prompt_token_ids=[(start + i) % 997 for i in range(n)],
                   sampling_params=SamplingParams(max_tokens=max_tokens))


def run_to_end(scheduler, max_tokens, check_step=None):
    """Steps as the engine takes them until every request has max_tokens outputs; `check_step(out)` after each."""
    for _ in range(10_000):
        if not scheduler.has_unfinished():
            return
        out = scheduler.schedule()
        scheduler.on_step_done(out)
        for chunk in out.chunks:
            req = scheduler.requests[chunk.request_id]
            if chunk.sample:
                req.output_token_ids.append(7)
        if check_step is not None:
            check_step(out)
        for chunk in out.chunks:
            req = scheduler.requests[chunk.request_id]
            if len(req.output_token_ids) >= max_tokens:
                scheduler.finish(req, RequestStatus.FINISHED_LENGTH)
    raise AssertionError("requests never finished")


def live(table) -> list[int]:
    return [i for i, b in enumerate(table) if b != FREED_BLOCK]


def test_kv_groups_imports_no_torch():
    code = "import sys, cpllm.kv_groups; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def tiny_config(**fields) -> ModelConfig:
    base = dict(architecture="Qwen2ForCausalLM", vocab_size=300, hidden_size=64, intermediate_size=128,
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    return ModelConfig(**{**base, **fields})


def test_groups_follow_the_layer_kinds():
    assert kv_groups(tiny_config(), 256) == (KVGroupSpec(window=None, layers=(0, 1, 2, 3)),)
    mistral = tiny_config(architecture="MistralForCausalLM", sliding_window=8)
    assert kv_groups(mistral, 256) == (KVGroupSpec(window=8, layers=(0, 1, 2, 3)),)
    hybrid = tiny_config(sliding_window=8, layer_types=("full_attention", "sliding_attention", "full_attention",
                                                        "sliding_attention"))
    groups = kv_groups(hybrid, 256)
    assert groups == (KVGroupSpec(window=None, layers=(0, 2)), KVGroupSpec(window=8, layers=(1, 3)))
    assert layer_groups(groups) == (0, 1, 0, 1)
    # a window no shorter than the longest request hides nothing: its layers keep every block
    assert kv_groups(hybrid, 8) == (KVGroupSpec(window=None, layers=(0, 1, 2, 3)),)


def test_block_arithmetic_against_brute_force():
    for window in range(1, 20):
        for first_query in range(0, 60):
            first = first_kept_block(window, first_query, V)
            needed = [p // V for p in range(max(0, first_query - window + 1), first_query + 1)]
            assert first == min(needed), (window, first_query)
        for new in (1, 3, 9):
            most = max(blocks_touched(max(0, p - window + 1), p + new, V) for p in range(200))
            assert window_blocks(window, V, new) == most, (window, new)
    for blocks in range(1, 8):
        for p in range(0, 40):
            n = max_chunk(6, p, blocks, V)
            assert blocks_touched(first_kept_block(6, p, V) * V, p + n, V) <= blocks
            assert blocks_touched(first_kept_block(6, p, V) * V, p + n + 1, V) > blocks


def test_windowed_group_frees_exactly_the_blocks_before_the_window():
    window = 6
    scheduler, pools = make([FULL, windowed(window)], [64, 64], budget=8)
    scheduler.add_request(request("a", 30, max_tokens=12))

    def check(out):
        (chunk,) = out.chunks
        req = scheduler.requests["a"]
        full, slid = chunk.group_table(0), chunk.group_table(1)
        assert FREED_BLOCK not in full and len(full) == len(slid)
        # during the step: every key the chunk's queries can see is in a live block, nothing else is
        first_key = max(0, chunk.start_pos - window + 1)
        assert live(slid) == list(range(first_key // V, len(slid)))
        # after it (next query at num_computed_tokens): the same rule, and at most the window plus a block
        p = req.num_computed_tokens
        table = req.block_tables[1]
        assert live(table) == list(range(first_kept_block(window, p, V), len(table)))
        assert all(q // V in live(table) for q in range(max(0, p - window + 1), p))
        assert scheduler.request_blocks("a")[1] <= window_blocks(window, V)
        assert scheduler.request_blocks("a")[0] == len(table)

    run_to_end(scheduler, 12, check)
    assert scheduler.peak_request_blocks[1] <= window_blocks(window, V, 8) < scheduler.peak_request_blocks[0]
    assert [p.num_free for p in pools] == [64, 64]


def test_slid_out_blocks_are_reused_and_a_prompt_longer_than_the_pool_runs():
    window, budget = 7, 8
    blocks = window_blocks(window, V, budget)  # the whole pool: one request's window plus one chunk
    scheduler, pools = make([windowed(window, 0)], [blocks], budget=budget)
    scheduler.add_request(request("long", 10 * blocks * V, max_tokens=5))
    seen: set[int] = set()
    entries = 0

    def check(out):
        nonlocal entries
        for chunk in out.chunks:
            seen.update(b for b in chunk.block_table if b != FREED_BLOCK)
            entries = len(chunk.block_table)
            assert scheduler.request_blocks(chunk.request_id)[0] <= blocks

    run_to_end(scheduler, 5, check)
    assert entries > 10 * blocks  # the request's table spans 10x the pool ...
    assert seen == set(range(blocks))  # ... over the same few physical blocks
    assert pools[0].num_free == blocks and scheduler.num_preemptions == 0


def test_small_pool_caps_the_chunk_instead_of_preempting_forever():
    window = 9
    blocks = window_blocks(window, V)  # only a decode step's keys: chunks must shrink to fit
    scheduler, _ = make([windowed(window, 0)], [blocks], budget=64)
    scheduler.add_request(request("r", 50, max_tokens=3))
    sizes = []

    def check(out):
        (chunk,) = out.chunks
        sizes.append(len(chunk.token_ids))
        assert blocks_touched(first_kept_block(window, chunk.start_pos, V) * V, chunk.end_pos, V) <= blocks

    run_to_end(scheduler, 3, check)
    assert max(sizes) < 50 and scheduler.num_preemptions == 0


def test_two_requests_share_a_tight_windowed_pool_without_losing_either():
    window = 6
    blocks = window_blocks(window, V) + window_blocks(window, V, 5)
    scheduler, pools = make([FULL, windowed(window)], [200, blocks], budget=16)
    for i in range(3):
        scheduler.add_request(request(f"r{i}", 21, start=100 * i, max_tokens=9))
    done = set()

    def check(out):
        for rid in list(scheduler.requests):
            done.update([rid] if len(scheduler.requests[rid].output_token_ids) >= 9 else [])

    run_to_end(scheduler, 9, check)
    assert done == {"r0", "r1", "r2"} and [p.num_free for p in pools] == [200, blocks]


def test_several_windows_each_keep_their_own():
    groups = [FULL, windowed(5, 1), windowed(13, 2)]
    scheduler, pools = make(groups, [64, 64, 64], budget=6)
    scheduler.add_request(request("a", 40, max_tokens=10))

    def check(out):
        req = scheduler.requests["a"]
        for g, group in enumerate(groups):
            table = req.block_tables[g]
            assert live(table) == list(range(first_kept_block(group.window, req.num_computed_tokens, V),
                                             len(table)))

    run_to_end(scheduler, 10, check)
    assert scheduler.peak_request_blocks[1] < scheduler.peak_request_blocks[2] < scheduler.peak_request_blocks[0]


@pytest.mark.parametrize(("evicted", "hit"), [(0, 20), (1, 20), (3, 20), (4, 0)])
def test_prefix_hit_needs_the_window_blocks_not_the_ones_before(evicted, hit):
    """A 24-token prompt ran and finished; a copy may skip 5 blocks (the last is recomputed), for which the
    windowed group needs only blocks 3 and 4 (the window of the query at 20). Its blocks 0-3 slid out first, so
    they are evicted first: without 0-2 the hit stands; without 3 too, every shorter hit's window lacks a block."""
    window = 6
    scheduler, pools = make([FULL, windowed(window)], [16, 16], budget=64)
    scheduler.add_request(request("a", 24))  # 6 full blocks
    scheduler.on_step_done(scheduler.schedule())
    assert live(scheduler.requests["a"].block_tables[1]) == [4, 5]  # blocks 0-3 freed, still cached
    scheduler.finish(scheduler.requests["a"], RequestStatus.FINISHED_STOPPED)
    never_used = 16 - 6
    pools[1].free(pools[1].allocate(never_used + evicted))  # least recently freed first: block 0, 1, ...
    scheduler.add_request(request("b", 24))
    (chunk,) = scheduler.schedule().chunks
    assert chunk.start_pos == hit
    if hit:
        assert chunk.group_table(1)[:3] == (FREED_BLOCK,) * 3 and FREED_BLOCK not in chunk.group_table(0)
        assert len(chunk.group_table(1)) == 6 and scheduler.num_prefix_hit_tokens == 20


def test_full_group_alone_needs_the_whole_chain():
    scheduler, pools = make([FULL, windowed(6)], [16, 16], budget=64)
    scheduler.add_request(request("a", 24))
    scheduler.on_step_done(scheduler.schedule())
    scheduler.finish(scheduler.requests["a"], RequestStatus.FINISHED_STOPPED)
    pools[0].free(pools[0].allocate(10 + 1))  # evict the full group's block 5 (freed first: the tail)
    scheduler.add_request(request("b", 24))
    assert scheduler.schedule().chunks[0].start_pos == 20  # block 5 is recomputed anyway
    scheduler.finish(scheduler.requests["b"], RequestStatus.FINISHED_ABORTED)
    pools[0].free(pools[0].allocate(16))  # every full block gone: no hit, whatever the windowed pool holds
    scheduler.add_request(request("c", 24))
    assert scheduler.schedule().chunks[0].start_pos == 0


def test_memory_goes_to_full_layers_what_windows_do_not_need():
    # 1 full layer, 2 windowed; 100 bytes per layer block; budget of 30 blocks in every layer
    assert split_blocks((1, 2), (None, 12), 100, 9000) == (66, 12)
    assert split_blocks((1, 2), (None, 40), 100, 9000) == (30, 30)  # the window needs more than an even share
    assert split_blocks((4,), (None,), 100, 9000) == (22,)  # one group: budget // (layers x block bytes)
    assert split_blocks((4,), (10,), 100, 9000) == (10,)  # capped at what the run can use
    assert split_blocks((1, 1, 2), (5, None, 9), 100, 9000) == (5, 67, 9)
    needs = group_block_needs((FULL, windowed(6)), V, max_num_seqs=2, max_model_len=256,
                              max_num_batched_tokens=16)
    assert needs == (2 * 64, 2 * (window_blocks(6, V) + 1) + 4)


def test_only_full_groups_bound_the_request_length():
    window = windowed(8)
    assert length_capacity((FULL,), (30,), V) == 120
    assert length_capacity((FULL, window), (30, 5), V) == 120  # the windowed pool's 20 tokens do not count
    assert length_capacity((window, windowed(16, 2)), (5, 7), V) is None  # every layer slides: no bound
    # a full group is the bound even where it has more blocks than a windowed one, and the smallest full one wins
    assert length_capacity((FULL, KVGroupSpec(window=None, layers=(2,)), window), (30, 25, 90), V) == 100
