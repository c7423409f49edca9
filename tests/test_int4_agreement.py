"""The ranks of one replica take one int4 GEMM threshold, the highest any of them measured, and one AMX tile bound,
the lowest any of them measured (two gloo processes)."""

from __future__ import annotations

import traceback

import pytest
import torch
import torch.multiprocessing as mp

from cpllm.config.engine import ParallelConfig
from cpllm.distributed.launch import find_free_port, init_distributed, shutdown_distributed
from cpllm.kernels import int4_avx2, int4_choice
from cpllm.model.formats.group_kernels import Int4Linear
from cpllm.model.formats.groups import Int4Groups
from cpllm.worker.int4_agreement import agree_gemm_threshold

TIMEOUT_S = 60.0
"""Bound of every collective: a broken agreement fails instead of hanging."""
MEASURED = (64, 128)
"""The threshold each rank's (replaced) start-up probe gives."""
TILES = (1024, 512)
"""The AMX tile bound each rank's probe gives."""


def _int4_layers(count: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(0)
    groups = Int4Groups(codes=torch.randint(0, 16, (32, 64), dtype=torch.uint8, generator=gen),
                        d=torch.rand(32, 2, generator=gen), m=torch.rand(32, 2, generator=gen))
    return torch.nn.Sequential(*(Int4Linear(groups) for _ in range(count)))


def _rank_main(rank: int, port: int, results) -> None:
    try:
        torch.set_num_threads(1)
        measured = int4_choice.Int4Choice(backend="avx2", gemm_from_rows=MEASURED[rank], gemm_dtype="bfloat16",
                                          decode_gbps=0.0, gemm_gflops={}, records_below=TILES[rank], reason="test")
        int4_choice.choose = lambda features=None: measured  # each rank's own probe, set apart on purpose
        groups = init_distributed(ParallelConfig(prefill_context_parallel_size=2, distributed_timeout_s=TIMEOUT_S),
                                  rank=rank, world_size=2, master_addr="127.0.0.1", master_port=port,
                                  timeout_s=TIMEOUT_S, backend="gloo")
        try:
            model = _int4_layers(2)
            agreed = agree_gemm_threshold(model, groups.moe_group, torch.device("cpu"))
            thresholds = [(layer.gemm_from_rows, layer.records_below) for layer in model]
            # a rank whose model has no int4 layer still joins, and leaves the other's threshold its own
            alone = agree_gemm_threshold(_int4_layers(1) if rank == 0 else torch.nn.Linear(2, 2), groups.moe_group,
                                         torch.device("cpu"))
            results.put((rank, "ok", (agreed, thresholds, alone)))
        finally:
            shutdown_distributed()
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


@pytest.mark.skipif(not int4_avx2.available(), reason="the int4 integer kernels are not built here")
def test_ranks_take_the_highest_threshold_and_lowest_tile_bound():
    ctx = mp.get_context("spawn")
    results, port = ctx.Queue(), find_free_port()
    procs = [ctx.Process(target=_rank_main, args=(rank, port, results), daemon=True) for rank in range(2)]
    for proc in procs:
        proc.start()
    try:
        reports = dict((rank, (status, value)) for rank, status, value in
                       (results.get(timeout=2 * TIMEOUT_S) for _ in procs))
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    for rank, (status, value) in reports.items():
        assert status == "ok", f"rank {rank}: {value}"
    assert reports[0][1] == (128, [(128, 512), (128, 512)], 64)
    assert reports[1][1] == (128, [(128, 512), (128, 512)], None)
