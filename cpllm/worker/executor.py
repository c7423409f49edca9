"""The replica driver's handle on every rank of its replica: runs a step everywhere, returns the logits."""

from __future__ import annotations

import contextlib

import torch

from cpllm.config import EngineConfig
from cpllm.distributed.comm import broadcast_object
from cpllm.distributed.groups import ParallelGroups
from cpllm.distributed.launch import shutdown_distributed
from cpllm.distributed.rank_processes import WorkerHandles
from cpllm.step import SchedulerOutput
from cpllm.worker.runner import ModelRunner
from cpllm.worker.worker import device_for


class Executor:
    """Owns this rank's ModelRunner and broadcasts each step to the other ranks of the replica."""

    def __init__(self, config: EngineConfig, groups: ParallelGroups, workers: WorkerHandles | None = None):
        self.config, self.groups, self.workers = config, groups, workers
        with self._watch():
            self.runner = ModelRunner(config, groups, device_for(groups))
        self._closed = False

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    def _watch(self):
        """Turns a dead spawned worker into an error naming its rank (torchrun watches its own processes)."""
        return self.workers.watch() if self.workers is not None else contextlib.nullcontext()

    def execute(self, step: SchedulerOutput) -> torch.Tensor | None:
        with self._watch():
            broadcast_object(step, src=self.groups.replica_driver, group=self.groups.replica_group)
            return self.runner.execute(step)

    def shutdown(self) -> None:
        """Stop this replica's workers (the shutdown step), then wait for the processes this driver spawned."""
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
