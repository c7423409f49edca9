"""Start-up and roles: the one module that brings the driver side (engine) and the rank side (worker) together.

`create_engine` runs on every process that builds an engine (`LLM`, the CLI, the
server). Global rank 0 spawns ranks 1..world-1 on one machine (or joins under
torchrun) and becomes the front; every other rank serves steps until the front
shuts the world down: a replica driver runs its own engine (data parallelism),
a plain worker runs the step loop.
"""

from __future__ import annotations

import logging

import torch

from cpllm.config import EngineConfig
from cpllm.distributed.groups import ParallelGroups
from cpllm.distributed.launch import find_free_port, init_distributed, is_torchrun, shutdown_distributed, torchrun_env
from cpllm.distributed.rank_processes import WorkerHandles, spawn_workers
from cpllm.engine.data_parallel import DataParallelFront, serve_replica
from cpllm.engine.engine import LLMEngine
from cpllm.engine.replica_front import ReplicaFront
from cpllm.model.tokenizer import Tokenizer, load_tokenizer
from cpllm.worker.executor import Executor
from cpllm.worker.worker import run_worker

DEFAULT_REPLICA_RESTARTS = 3
"""Restarts of each failed DP replica (--max-replica-restarts) before it stays out of rotation."""


def create_engine(config: EngineConfig, tokenizer: Tokenizer, *, threads_per_rank: int | None = None,
                  max_replica_restarts: int = DEFAULT_REPLICA_RESTARTS):
    """The engine of global rank 0 (a DP front when DP > 1). On any other rank (torchrun) this serves
    steps until the front shuts the world down, then exits the process.

    Spawned DP replicas are isolated (engine/replica_front.py): each its own process tree, restarted up to
    `max_replica_restarts` times. Under torchrun the replicas share one world and advance in lockstep
    (engine/data_parallel.py); torchrun's own --max-restarts restarts that world."""
    if max_replica_restarts < 0:
        raise ValueError(f"max_replica_restarts must be >= 0, got {max_replica_restarts}")
    if config.parallel.data_parallel_size > 1 and not is_torchrun():
        return _replica_front(config, tokenizer, threads_per_rank, max_replica_restarts)
    groups, workers = start_ranks(config, threads_per_rank)
    if groups.rank != 0:
        try:
            serve_rank(config, groups)
        finally:
            shutdown_distributed()
        raise SystemExit(0)
    engine = LLMEngine(config, tokenizer, Executor(config, groups, workers))
    return DataParallelFront(engine, groups) if groups.dp_size > 1 else engine


def _replica_front(config: EngineConfig, tokenizer: Tokenizer, threads_per_rank: int | None,
                   max_restarts: int) -> ReplicaFront:
    from cpllm.replica_process import replica_config, replica_main  # it imports this module

    one = replica_config(config)
    level = logging.getLogger().getEffectiveLevel()

    def start(index: int, commands: str, front: str, incarnation: int) -> tuple:
        return replica_main, (one, commands, front, incarnation, threads_per_rank, level)

    return ReplicaFront(config, tokenizer, start, max_restarts=max_restarts)


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
