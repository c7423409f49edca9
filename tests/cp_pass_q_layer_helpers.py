"""Rank side of tests/test_cp_pass_q_layer.py: the pass-Q strategy of PagedCPAttention in real gloo groups.

Reuses tests/cp_layer_helpers.py case by case (same scenarios, same float64 reference, same exact check of the KV
pools), with the step's metadata built for a plan of strategy pass-Q (`eager_plan(..., strategy="pass-q")`), which
carries the plan of where each new token's K/V is stored.
"""

from __future__ import annotations

import functools
import traceback

import torch

import cp_layer_helpers as helpers
from cpllm.config.engine import ParallelConfig
from cpllm.context_parallel import pass_q as pass_q_module
from cpllm.distributed.groups import ParallelGroups
from cpllm.distributed.launch import init_distributed, shutdown_distributed

STRATEGY = "pass-q"
INTERLEAVES = (1, 2, 4)
SCENARIOS = helpers.SCENARIOS


def run_pass_q_case(groups: ParallelGroups, interleave: int, name: str, seed: int) -> dict:
    original = helpers.eager_plan
    helpers.eager_plan = functools.partial(original, strategy=STRATEGY)
    try:
        return helpers.run_case(groups, STRATEGY, interleave, name, seed)
    finally:
        helpers.eager_plan = original


def ring_events(groups: ParallelGroups, seed: int) -> tuple[list, dict]:
    """A pass-Q step of fresh prompts with the query ring and the attention calls logged, and its result."""
    return helpers.logged_ring(pass_q_module, lambda: run_pass_q_case(groups, 1, "ring_order", seed))


def run_world(rank: int, world: int, port: int, pcp: int, dcp: int) -> dict:
    parallel = ParallelConfig(tensor_parallel_size=dcp, prefill_context_parallel_size=pcp,
                              decode_context_parallel_size=dcp, distributed_timeout_s=helpers.TIMEOUT_S)
    groups = init_distributed(parallel, rank=rank, world_size=world, master_addr="127.0.0.1", master_port=port,
                              timeout_s=helpers.TIMEOUT_S, backend="gloo")
    try:
        report = {"coords": (groups.pcp_rank, groups.tp_rank, groups.cp_rank), "cases": {}}
        keys = [(i, name) for i in INTERLEAVES for name in SCENARIOS]
        for seed, (interleave, name) in enumerate(keys):
            report["cases"][(interleave, name)] = run_pass_q_case(groups, interleave, name, seed)
        report["ring"] = ring_events(groups, seed=1000)
        return report
    finally:
        shutdown_distributed()


def rank_main(rank: int, worlds: list[tuple[int, int, int]], results) -> None:
    """Global rank `rank` of every world `(pcp, dcp, port)` it belongs to, largest world first (as in
    cp_layer_helpers.rank_main)."""
    torch.set_num_threads(1)
    for pcp, dcp, port in worlds:
        if rank >= pcp * dcp:
            continue
        try:
            results.put(((pcp, dcp), rank, "ok", run_world(rank, pcp * dcp, port, pcp, dcp)))
        except BaseException:
            results.put(((pcp, dcp), rank, "error", traceback.format_exc()))
            return
