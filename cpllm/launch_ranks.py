"""The ranks of one world: the module that brings the driver side (engine) and the rank side (worker) together.

Global rank 0 spawns ranks 1..world-1 on one machine (or joins under torchrun) and becomes the front; every other
rank serves steps until the front shuts the world down: a replica driver runs its own engine (data parallelism
under torchrun), a plain worker runs the step loop. A spawned DP replica's process builds its engine here too
(cpllm/replica_process.py).
"""

from __future__ import annotations

import torch

from cpllm.config.engine import EngineConfig
from cpllm.distributed.groups import ParallelGroups
from cpllm.distributed.launch import find_free_port, init_distributed, is_torchrun, shutdown_distributed, torchrun_env
from cpllm.distributed.rank_processes import WorkerHandles, spawn_workers
from cpllm.engine.data_parallel import DataParallelFront, serve_replica
from cpllm.engine.engine import LLMEngine
from cpllm.model.tokenization.tokenizer import Tokenizer, load_tokenizer
from cpllm.worker.executor import Executor
from cpllm.worker.worker import run_worker


def create_rank_engine(config: EngineConfig, tokenizer: Tokenizer, *, threads_per_rank: int | None = None):
    """The engine of global rank 0 of this world (a lockstep DP front when DP > 1 under torchrun). On any other
    rank this serves steps until the front shuts the world down, then exits the process."""
    groups, workers = start_ranks(config, threads_per_rank)
    if groups.rank != 0:
        try:
            serve_rank(config, groups)
        finally:
            shutdown_distributed()
        raise SystemExit(0)
    engine = LLMEngine(config, tokenizer, Executor(config, groups, workers))
    return DataParallelFront(engine, groups) if groups.dp_size > 1 else engine


def start_ranks(config: EngineConfig, threads_per_rank: int | None) -> tuple[ParallelGroups, WorkerHandles | None]:
    """Join the world as this process's rank; on one machine, rank 0 first spawns ranks 1..world-1."""
    timeout_s = config.parallel.distributed_timeout_s
    world = config.parallel.dims.world_size
    workers = None
    if is_torchrun():
        env = torchrun_env()
        groups = init_distributed(config.parallel, rank=env["rank"], world_size=env["world_size"],
                                  master_addr=env["master_addr"], master_port=env["master_port"], timeout_s=timeout_s)
    elif world > 1:
        port = find_free_port()
        workers = spawn_workers(world, worker_main, (config, "127.0.0.1", port, threads_per_rank), master_port=port)
        groups = init_distributed(config.parallel, rank=0, world_size=world, master_addr="127.0.0.1",
                                  master_port=port, timeout_s=timeout_s, workers=workers)
    else:
        groups = ParallelGroups.single(config.parallel.dims)
    if threads_per_rank:
        torch.set_num_threads(threads_per_rank)
    return groups, workers


def serve_rank(config: EngineConfig, groups: ParallelGroups) -> None:
    """Everything a rank other than global rank 0 does until the front shuts the world down."""
    if groups.is_replica_driver:
        engine = LLMEngine(config, load_tokenizer(config.model_path), Executor(config, groups))
        serve_replica(engine, groups)
    else:
        run_worker(config, groups)


def worker_main(rank: int, config: EngineConfig, master_addr: str, master_port: int, threads: int | None) -> None:
    """Entry point of a spawned rank (global rank >= 1), run by `cpllm.distributed.rank_entry`."""
    if threads:
        torch.set_num_threads(threads)
    groups = init_distributed(config.parallel, rank=rank, world_size=config.parallel.dims.world_size,
                              master_addr=master_addr, master_port=master_port,
                              timeout_s=config.parallel.distributed_timeout_s)
    try:
        serve_rank(config, groups)
    finally:
        shutdown_distributed()
