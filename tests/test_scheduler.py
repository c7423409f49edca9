"""Scheduler and block pool on their own (no torch, no model): budgets, chunking, prefix hits, preemption, abort."""

from __future__ import annotations

import sys

from cpllm.config.engine import SchedulerConfig
from cpllm.engine.kv_blocks import BlockPool
from cpllm.engine.request import Request, RequestStatus
from cpllm.engine.sampling_params import SamplingParams
from cpllm.engine.scheduler import Scheduler


def make(num_blocks=64, tokens_per_block=4, budget=16, max_seqs=8, caching=True):
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, max_model_len=256)
    pool = BlockPool(num_blocks, caching)
    return Scheduler(config, pool, tokens_per_block), pool


def request(rid, n, start=10):
    return Request(request_id=rid, prompt_token_ids=list(range(start, start + n)),
                   sampling_params=SamplingParams(max_tokens=8))


def run_step(scheduler, next_token=1):
    """One step as the engine does it: schedule, mark computed, append a token where sampled."""
    out = scheduler.schedule()
    scheduler.on_step_done(out)
    for chunk in out.chunks:
        if chunk.sample:
            scheduler.requests[chunk.request_id].output_token_ids.append(next_token)
    return out


def test_scheduler_imports_no_torch():
    import subprocess

    code = "import sys, cpllm.engine.scheduler, cpllm.engine.kv_blocks, cpllm.step; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_budget_chunks_a_long_prompt_and_mixes_decodes():
    scheduler, _ = make(budget=16)
    scheduler.add_request(request("short", 3))
    run_step(scheduler)  # prefill of "short", samples its first token
    scheduler.add_request(request("long", 40))
    chunks_seen = []
    for _ in range(4):
        out = run_step(scheduler)
        assert out.num_tokens <= 16
        chunks_seen.append({c.request_id: (c.start_pos, len(c.token_ids), c.sample) for c in out.chunks})
    assert chunks_seen[0] == {"short": (3, 1, True), "long": (0, 15, False)}
    assert chunks_seen[1] == {"short": (4, 1, True), "long": (15, 15, False)}
    assert chunks_seen[2] == {"short": (5, 1, True), "long": (30, 10, True)}
    assert chunks_seen[3]["long"] == (40, 1, True)


def test_prefix_cache_hits_full_blocks_and_leaves_a_token_to_compute():
    scheduler, pool = make()
    scheduler.add_request(request("a", 16))
    run_step(scheduler)
    scheduler.finish(scheduler.requests["a"], RequestStatus.FINISHED_STOPPED)
    scheduler.add_request(request("b", 16))  # same 16 tokens = 4 full blocks, all cached
    out = scheduler.schedule()
    (chunk,) = out.chunks
    assert chunk.start_pos == 12 and len(chunk.token_ids) == 4  # last block recomputed to sample from
    assert scheduler.num_prefix_hit_tokens == 12
    scheduler.add_request(request("c", 10, start=10))  # shares the first 2 blocks (8 tokens)
    out = scheduler.schedule()
    assert {c.request_id: c.start_pos for c in out.chunks}["c"] == 8


def test_preemption_recomputes_without_losing_requests():
    scheduler, pool = make(num_blocks=6, budget=64)
    for i in range(3):
        scheduler.add_request(request(f"r{i}", 7, start=10 + 20 * i))
    finished = set()
    for _ in range(200):
        if not scheduler.has_unfinished():
            break
        out = run_step(scheduler)
        for chunk in out.chunks:
            req = scheduler.requests.get(chunk.request_id)
            if req is not None and len(req.output_token_ids) >= 8:
                scheduler.finish(req, RequestStatus.FINISHED_LENGTH)
                finished.add(req.request_id)
    assert finished == {"r0", "r1", "r2"}
    assert scheduler.num_preemptions > 0
    assert pool.num_free == pool.num_blocks


def test_abort_frees_blocks():
    scheduler, pool = make(caching=False)
    scheduler.add_request(request("x", 30))
    run_step(scheduler)
    assert pool.num_free < pool.num_blocks
    scheduler.finish(scheduler.requests["x"], RequestStatus.FINISHED_ABORTED)
    assert pool.num_free == pool.num_blocks and not scheduler.has_unfinished()


def test_max_num_seqs_limits_running_requests():
    scheduler, _ = make(max_seqs=2, budget=100)
    for i in range(4):
        scheduler.add_request(request(f"r{i}", 5, start=50 * i))
    out = scheduler.schedule()
    assert [c.request_id for c in out.chunks] == ["r0", "r1"]


def test_a_request_preempted_in_a_step_is_not_rescheduled_in_that_step():
    # Three blocks and a 5-token budget: "b" runs out of blocks mid-decode and
    # preempts itself, after which one block is free again, enough for its
    # first recomputed chunk; it must still wait until the next step.
    scheduler, pool = make(num_blocks=3, budget=5, caching=False)
    scheduler.add_request(request("a", 4))
    scheduler.add_request(request("b", 4, start=50))
    preempted_seen = 0
    for _ in range(12):
        preemptions_before = {rid: r.num_preemptions for rid, r in scheduler.requests.items()}
        out = run_step(scheduler)
        preempted = {rid for rid, n in preemptions_before.items() if scheduler.requests[rid].num_preemptions > n}
        assert not preempted & {c.request_id for c in out.chunks}, out
        preempted_seen += len(preempted)
    assert preempted_seen > 0


def test_prefix_hits_released_by_a_failed_allocation_are_not_counted():
    scheduler, pool = make(num_blocks=4, budget=16)
    scheduler.add_request(request("a", 8))  # 2 full blocks, cached once "a" finishes
    run_step(scheduler)
    scheduler.finish(scheduler.requests["a"], RequestStatus.FINISHED_STOPPED)
    scheduler.add_request(request("hog", 8, start=200))  # takes the 2 never-used blocks
    scheduler.add_request(request("b", 16))  # hits a's 2 blocks but needs 2 more: none free
    for _ in range(3):
        out = scheduler.schedule()
        assert [c.request_id for c in out.chunks] in (["hog"], [])
        scheduler.on_step_done(out)
    assert scheduler.requests["b"].status is RequestStatus.WAITING
    assert scheduler.num_prefix_hit_tokens == 0
    scheduler.finish(scheduler.requests["hog"], RequestStatus.FINISHED_STOPPED)
    out = scheduler.schedule()
    (chunk,) = out.chunks
    assert chunk.request_id == "b" and chunk.start_pos == 8
    assert scheduler.num_prefix_hit_tokens == 8


def test_a_producer_keeps_its_states_after_all_but_the_last_prompt_token():
    """Disaggregated producer of a model with states: the prompt's chunk ends before its last token and saves
    the states into a held slot (after the live slots), which the finished request keeps until its release; a
    third prompt waits while both held slots are taken."""
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=2, max_model_len=256)
    scheduler = Scheduler(config, BlockPool(64, False), 4, state_slots=2, held_state_slots=2)
    for k, rid in enumerate(("a", "b", "c")):
        r = request(rid, 10, start=10 * k)
        r.kv_hold = True
        scheduler.add_request(r)
    first = run_step(scheduler)
    assert [(c.request_id, c.start_pos, len(c.token_ids), c.state_save) for c in first.chunks] == [
        ("a", 0, 9, 2), ("b", 0, 9, 3)]
    last = run_step(scheduler)
    assert [(c.start_pos, c.sample, c.state_save) for c in last.chunks] == [(9, True, -1), (9, True, -1)]
    for rid in ("a", "b"):
        scheduler.finish(scheduler.requests[rid], RequestStatus.FINISHED_LENGTH)
    assert scheduler.held_states == {"a": 2, "b": 3} and scheduler.free_held_slots == []
    assert run_step(scheduler).chunks == ()  # no held slot left for c
    scheduler.release_held("a")
    assert scheduler.held_states == {"b": 3}
    assert [(c.request_id, c.state_save) for c in run_step(scheduler).chunks] == [("c", 2)]
