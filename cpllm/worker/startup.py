"""Brings up every rank of the world: spawned on one machine, or joined under torchrun."""

from __future__ import annotations

import torch

from cpllm.config import EngineConfig
from cpllm.distributed.groups import ParallelGroups
from cpllm.distributed.launch import (
    WorkerHandles,
    find_free_port,
    init_distributed,
    is_torchrun,
    spawn_workers,
    torchrun_env,
)


def start_ranks(config: EngineConfig, threads_per_rank: int | None) -> tuple[ParallelGroups, WorkerHandles | None]:
    """Join the world as this process's rank; on one machine, rank 0 first spawns ranks 1..world-1."""
    from cpllm.worker.worker import worker_main  # the spawned entry point imports this module

    timeout_s = config.parallel.distributed_timeout_s
    world = config.parallel.world_size
    workers = None
    if is_torchrun():
        env = torchrun_env()
        groups = init_distributed(config.parallel, rank=env["rank"], world_size=env["world_size"],
                                  master_addr=env["master_addr"], master_port=env["master_port"], timeout_s=timeout_s)
    elif world > 1:
        port = find_free_port()
        workers = spawn_workers(world, worker_main, (config, "127.0.0.1", port, threads_per_rank), master_port=port)
        groups = init_distributed(config.parallel, rank=0, world_size=world, master_addr="127.0.0.1",
                                  master_port=port, timeout_s=timeout_s)
    else:
        groups = ParallelGroups.single()
    if threads_per_rank:
        torch.set_num_threads(threads_per_rank)
    return groups, workers
