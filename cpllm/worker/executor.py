"""Starts the ranks of one replica and drives them step by step from the driver process."""

from __future__ import annotations

import contextlib
import logging

import torch

from cpllm.config import EngineConfig
from cpllm.distributed.comm import broadcast_object
from cpllm.distributed.launch import (
    find_free_port,
    init_distributed,
    is_torchrun,
    shutdown_distributed,
    spawn_workers,
    torchrun_env,
)
from cpllm.engine.scheduler import SchedulerOutput
from cpllm.worker.runner import ModelRunner
from cpllm.worker.worker import device_for, run_worker_loop, worker_main

logger = logging.getLogger(__name__)


class Executor:
    """The driver's handle on every rank of its replica: runs a step everywhere, returns the logits."""

    def __init__(self, config: EngineConfig, *, threads_per_rank: int | None = None):
        self.config = config
        self.workers = None
        world = config.parallel.world_size
        if is_torchrun():
            env = torchrun_env()
            groups = init_distributed(config.parallel, rank=env["rank"], world_size=env["world_size"],
                                      master_addr=env["master_addr"], master_port=env["master_port"],
                                      timeout_s=config.parallel.distributed_timeout_s)
        elif world > 1:
            port = find_free_port()
            self.workers = spawn_workers(world, worker_main, (config, "127.0.0.1", port, threads_per_rank),
                                         master_port=port)
            groups = init_distributed(config.parallel, rank=0, world_size=world, master_addr="127.0.0.1",
                                      master_port=port, timeout_s=config.parallel.distributed_timeout_s)
        else:
            groups = init_distributed(config.parallel, rank=0, world_size=1, master_addr="", master_port=0,
                                      timeout_s=config.parallel.distributed_timeout_s)
        if threads_per_rank:
            torch.set_num_threads(threads_per_rank)
        self.groups = groups
        with self._watch():
            self.runner = ModelRunner(config, groups, device_for(groups))
        self._closed = False
        if not groups.is_replica_driver:
            # Under torchrun every process builds the engine; all but the drivers serve steps and leave.
            try:
                run_worker_loop(self.runner)
            finally:
                shutdown_distributed()
            raise SystemExit(0)

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    def _watch(self):
        return self.workers.watch() if self.workers is not None else contextlib.nullcontext()

    def execute(self, step: SchedulerOutput) -> torch.Tensor | None:
        with self._watch():
            broadcast_object(step, src=self.groups.replica_driver, group=self.groups.replica_group)
            return self.runner.execute(step)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self.groups.replica_size > 1:
                with self._watch():
                    broadcast_object(SchedulerOutput(step_id=-1, shutdown=True), src=self.groups.replica_driver,
                                     group=self.groups.replica_group)
            if self.workers is not None:
                self.workers.join(self.config.parallel.distributed_timeout_s)
        finally:
            if self.workers is not None:
                self.workers.terminate_all()
            shutdown_distributed()
