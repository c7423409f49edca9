"""The pass-Q strategy of PagedCPAttention in real multi-rank gloo groups, against plain causal attention.

The same worlds (PCP 2 and 3, DCP 1 and 2, TP = DCP), scenarios and checks as tests/test_cp_attention_layer.py:
every local row and head within ATOL of float64 causal attention over the request's whole sequence, and each
rank's KV pools holding exactly the context plus the new tokens it owns, here with the queries travelling round
the CP ring and the new K/V reaching their owners in the all-to-all that returns the partial outputs. Interleave
1, 2 and 4. A second test pins the overlap: each query block's transfer is posted before the block in hand is
attended and waited for after (a step without cached context rings over the PCP group only).
"""

from __future__ import annotations

import pytest

import cp_layer_helpers as helpers
import cp_pass_q_layer_helpers as pass_q_helpers
import test_cp_attention_layer as layer_test

WORLDS = layer_test.WORLDS
ATOL = layer_test.ATOL


@pytest.fixture(scope="module")
def reports():
    # The layer test's launcher, pointed at the pass-Q rank entry point.
    original = layer_test.helpers
    layer_test.helpers = pass_q_helpers
    try:
        return layer_test._launch_all()
    finally:
        layer_test.helpers = original


_world = layer_test._world
_world_id = layer_test._world_id


@pytest.mark.timeout(300)
@pytest.mark.parametrize("interleave", pass_q_helpers.INTERLEAVES, ids=lambda i: f"i{i}")
@pytest.mark.parametrize("world", WORLDS, ids=_world_id)
def test_pass_q_matches_causal_attention_over_whole_sequences(reports, world, interleave):
    pcp, dcp = world
    ranks = _world(reports, pcp, dcp)
    failures = []
    for name in pass_q_helpers.SCENARIOS:
        for rank, report in sorted(ranks.items()):
            case = report["cases"][(interleave, name)]
            where = f"{name} rank {rank} (pcp, tp, cp) = {report['coords']}"
            failures += [f"{where}: {p}" for p in case["problems"]]
            if not case["max_err"] <= ATOL:
                failures.append(f"{where}: max abs error {case['max_err']:.3g} > {ATOL} at {case['worst']} "
                                f"(outputs up to {case['max_ref']:.3g})")
        reqs = helpers.scenario(name, pcp, pcp * dcp)
        for tp in range(dcp):
            held = [ranks[p * dcp + tp]["cases"][(interleave, name)]["held"] for p in range(pcp)]
            for i, req in enumerate(reqs):
                for j in range(req.new):
                    count = sum(h.count(helpers.token_id(i, j)) for h in held)
                    if count != (pcp if req.new == 1 else 1):
                        failures.append(f"{name} tp {tp}: token {j} of request {i} on {count} PCP ranks")
    assert not failures, "\n".join(failures)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", WORLDS, ids=_world_id)
def test_query_ring_posts_next_block_before_attending_and_waits_after(reports, world):
    pcp, dcp = world
    ranks = _world(reports, pcp, dcp)
    failures = []
    for rank, report in sorted(ranks.items()):
        events, result = report["ring"]
        # Fresh prompts read no cached context: the queries ring over the PCP group only, PCP - 1 transfers.
        failures += [f"rank {rank}: {p}" for p in layer_test._check_ring_order(events, pcp)]
        failures += [f"rank {rank}: {p}" for p in result["problems"]]
        if not result["max_err"] <= ATOL:
            failures.append(f"rank {rank}: instrumented pass-Q step off by {result['max_err']:.3g}")
    assert not failures, "\n".join(failures)
