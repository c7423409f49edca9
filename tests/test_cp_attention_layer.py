"""PagedCPAttention in real multi-rank process groups (gloo) against plain causal attention.

Worlds of PCP x DCP ranks (TP = DCP, groups built by ParallelGroups.build as the engine does): PCP 2 and 3, DCP 1
and 2. One set of spawned processes (six) runs every world in turn, each in its own process group, and every case
of a world in that group (tests/cp_layer_helpers.py): both prefill strategies, interleave 1, 2 and 4, and steps that
mix chunked-prefill continuations, fresh prompts and decode rows (shared-prefix and padded decode paths, empty
shards, 1-token prompts), decode-only steps and prefill-only steps. Each rank compares every local row and head
with float64 causal attention over the request's whole sequence, and its KV pools with exactly the context plus
the new tokens it owns.

Tolerance: q and k are 4 x unit normals (peaked softmax, outputs of order 1, a wrong key moves them by O(1));
fp32 outputs must be within ATOL = 2e-5 (max abs) of the float64 reference (measured worst: about 6e-6).

A second test pins the ring's overlap: with ring_exchange and the backend's attend instrumented, block i's transfer
is posted before block i's attention and waited for after it.
"""

from __future__ import annotations

import queue as queue_mod
import time

import pytest
import torch.multiprocessing as mp

import cp_layer_helpers as helpers
from cpllm.distributed.launch import find_free_port

ATOL = 2e-5
WORLDS = [(2, 1), (3, 1), (2, 2), (3, 2)]
"""(PCP, DCP); world = PCP x DCP (TP = DCP)."""
HANG_GUARD_S = 240.0
"""Longest the whole module waits for its processes; only reached when something hangs past the gloo timeouts."""


def _launch_all() -> dict:
    """Run every world; return {(pcp, dcp): {rank: report}}, or an error text for a world that failed or hung.

    The processes of the largest world run every smaller world too, one after the other (largest first).
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    ports: list[int] = []
    while len(ports) < len(WORLDS):
        port = find_free_port()
        if port not in ports:
            ports.append(port)
    order = sorted(WORLDS, key=lambda w: -w[0] * w[1])
    plan = [(pcp, dcp, port) for (pcp, dcp), port in zip(order, ports)]
    size = max(pcp * dcp for pcp, dcp in WORLDS)
    procs = [ctx.Process(target=helpers.rank_main, args=(rank, plan, results), daemon=True) for rank in range(size)]
    for proc in procs:
        proc.start()
    reports: dict = {key: {} for key in WORLDS}
    pending = {(key, rank) for key in WORLDS for rank in range(key[0] * key[1])}
    deadline = time.monotonic() + HANG_GUARD_S
    try:
        while pending:
            try:
                key, rank, status, value = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue_mod.Empty:
                for key in {k for k, _ in pending}:
                    reports[key] = f"ranks {sorted(r for k, r in pending if k == key)} hung"
                break
            pending.discard((key, rank))
            if status == "ok":
                reports[key][rank] = value
                continue
            # The failed rank's peers are stuck in collectives, and later worlds need every process: stop all.
            reports[key] = f"rank {rank} failed:\n{value}"
            for other in {k for k, _ in pending} - {key}:
                reports[other] = f"not run: world PCP={key[0]} DCP={key[1]} failed first"
            break
    finally:
        for proc in procs:
            if pending:
                proc.kill()
            proc.join(30)
            if proc.exitcode is None:
                proc.kill()
                proc.join()
    return reports


@pytest.fixture(scope="module")
def reports():
    return _launch_all()


def _world(reports, pcp, dcp) -> dict:
    got = reports[(pcp, dcp)]
    if isinstance(got, str):
        pytest.fail(f"world PCP={pcp} DCP={dcp}: {got}")
    assert sorted(got) == list(range(pcp * dcp))
    return got


def _world_id(world):
    return f"pcp{world[0]}-dcp{world[1]}"


@pytest.mark.parametrize("interleave", helpers.INTERLEAVES, ids=lambda i: f"i{i}")
@pytest.mark.parametrize("strategy", helpers.STRATEGIES)
@pytest.mark.parametrize("world", WORLDS, ids=_world_id)
def test_layer_matches_causal_attention_over_whole_sequences(reports, world, strategy, interleave):
    pcp, dcp = world
    ranks = _world(reports, pcp, dcp)
    failures = []
    for name in helpers.SCENARIOS:
        key = (strategy, interleave, name)
        reqs = helpers.scenario(name, pcp, pcp * dcp)
        for rank, report in sorted(ranks.items()):
            case = report["cases"][key]
            where = f"{name} rank {rank} (pcp, tp, cp) = {report['coords']}"
            failures += [f"{where}: {p}" for p in case["problems"]]
            if not case["max_err"] <= ATOL:
                failures.append(f"{where}: max abs error {case['max_err']:.3g} > {ATOL} at {case['worst']} "
                                f"(outputs up to {case['max_ref']:.3g})")
            if name == "mixed_shared" and case["shared_keys"] is not True:
                failures.append(f"{where}: the shared-prefix decodes did not take the shared-key path")
            if name in ("mixed_padded", "decode_only") and case["shared_keys"] is not False:
                failures.append(f"{where}: the unrelated decodes did not take the padded path")
        # Every new token was computed and checked: a chunk token on exactly one PCP rank, a decode row on all.
        for tp in range(dcp):
            held = [ranks[p * dcp + tp]["cases"][key]["held"] for p in range(pcp)]
            for i, req in enumerate(reqs):
                for j in range(req.new):
                    count = sum(h.count(helpers.token_id(i, j)) for h in held)
                    want = pcp if req.new == 1 else 1
                    if count != want:
                        failures.append(f"{name} tp {tp}: token {j} of request {i} on {count} PCP ranks, want {want}")
    assert not failures, "\n".join(failures)


def _check_ring_order(events: list, pcp: int) -> list[str]:
    """Block i: post(i) < attend(block i) < wait(i), and block i's attention does not start before post(i)."""
    problems = []
    posts = [e for e in events if e[0] == "post"]
    if posts != [("post", i) for i in range(pcp - 1)]:
        return [f"expected {pcp - 1} ring transfers, got events {events}"]
    previous = -1
    for i in range(pcp - 1):
        if ("wait", i) not in events:
            return [f"transfer {i} never waited for: {events}"]
        post, wait = events.index(("post", i)), events.index(("wait", i))
        if not previous < post < wait:
            problems.append(f"step {i}: post at {post}, wait at {wait}, previous wait at {previous}: {events}")
        elif ("attend",) in events[previous + 1 : post]:
            problems.append(f"step {i}: block {i} attended before its successor's transfer was posted: {events}")
        elif ("attend",) not in events[post + 1 : wait]:
            problems.append(f"step {i}: no attention between posting and waiting (no overlap): {events}")
        previous = wait
    if ("attend",) not in events[previous + 1 :]:
        problems.append(f"the last block was never attended: {events}")
    return problems


@pytest.mark.parametrize("world", WORLDS, ids=_world_id)
def test_ring_posts_next_block_before_attending_and_waits_after(reports, world):
    pcp, dcp = world
    ranks = _world(reports, pcp, dcp)
    failures = []
    for rank, report in sorted(ranks.items()):
        events, result = report["ring"]
        failures += [f"rank {rank}: {p}" for p in _check_ring_order(events, pcp)]
        failures += [f"rank {rank}: {p}" for p in result["problems"]]
        if not result["max_err"] <= ATOL:
            failures.append(f"rank {rank}: instrumented ring step off by {result['max_err']:.3g}")
    assert not failures, "\n".join(failures)


def test_ring_order_check_rejects_a_loop_without_overlap():
    """The order check itself: a loop that waits right after posting, or attends before posting, fails it."""
    good = [("post", 0), ("attend",), ("wait", 0), ("post", 1), ("attend",), ("attend",), ("wait", 1), ("attend",)]
    assert _check_ring_order(good, 3) == []
    no_overlap = [("post", 0), ("wait", 0), ("attend",), ("post", 1), ("wait", 1), ("attend",), ("attend",)]
    assert _check_ring_order(no_overlap, 3)
    late_post = [("attend",), ("post", 0), ("wait", 0), ("attend",), ("post", 1), ("wait", 1), ("attend",)]
    assert _check_ring_order(late_post, 3)
    assert _check_ring_order([("attend",), ("attend",)], 2)  # no ring transfer at all
