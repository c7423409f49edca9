"""The non-front side of a world: plain workers run steps; other replicas' drivers run their own engine."""

from __future__ import annotations

import torch

from cpllm.config import EngineConfig
from cpllm.distributed.comm import broadcast_object
from cpllm.distributed.groups import ParallelGroups
from cpllm.distributed.launch import init_distributed, shutdown_distributed


def device_for(groups: ParallelGroups) -> torch.device:
    if groups.backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if groups.backend is None and torch.cuda.is_available():
        return torch.device("cuda", 0)
    return torch.device("cpu")


def run_worker_loop(runner) -> None:
    """SPMD loop of a non-driver rank; the driver of its replica sends every step."""
    groups = runner.groups
    while True:
        step = broadcast_object(None, src=groups.replica_driver, group=groups.replica_group)
        if step.shutdown:
            return
        runner.execute(step)


def serve_rank(config: EngineConfig, groups: ParallelGroups) -> None:
    """Everything a rank other than global rank 0 does until the front shuts the world down."""
    from cpllm.engine.data_parallel import serve_replica
    from cpllm.engine.engine import LLMEngine
    from cpllm.model.tokenizer import load_tokenizer
    from cpllm.worker.executor import Executor
    from cpllm.worker.runner import ModelRunner

    if groups.is_replica_driver:
        engine = LLMEngine(config, load_tokenizer(config.model_path), Executor(config, groups))
        serve_replica(engine)
    else:
        run_worker_loop(ModelRunner(config, groups, device_for(groups)))


def worker_main(rank: int, config: EngineConfig, master_addr: str, master_port: int, threads: int | None) -> None:
    """Entry point of a spawned process (global rank >= 1)."""
    if threads:
        torch.set_num_threads(threads)
    groups = init_distributed(config.parallel, rank=rank, world_size=config.parallel.world_size,
                              master_addr=master_addr, master_port=master_port,
                              timeout_s=config.parallel.distributed_timeout_s)
    try:
        serve_rank(config, groups)
    finally:
        shutdown_distributed()
