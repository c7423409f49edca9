"""The replica driver's handle on every rank of its replica: runs a step everywhere, returns the logits.

It is the driver side's only door to the ranks: what the engine, the server and the tests learn of a rank comes
out of it as plain data (cpllm/worker/rank_stats.py), never as the runner or the model.
"""

from __future__ import annotations

import contextlib

import torch

from cpllm.config.engine import EngineConfig
from cpllm.distributed.comm import broadcast_object
from cpllm.distributed.groups import ParallelGroups
from cpllm.distributed.launch import shutdown_distributed
from cpllm.distributed.rank_processes import WorkerHandles
from cpllm.step import SchedulerOutput
from cpllm.worker.draft_runner import DraftRunner
from cpllm.worker.rank_stats import RankInfo, RankStats
from cpllm.worker.runner import ModelRunner
from cpllm.worker.worker import device_for


class Executor:
    """Owns this rank's ModelRunner and broadcasts each step to the other ranks of the replica."""

    def __init__(self, config: EngineConfig, groups: ParallelGroups, workers: WorkerHandles | None = None):
        self.config, self._groups, self.workers = config, groups, workers
        with self._watch():
            self._runner = ModelRunner(config, groups, device_for(groups))
        self.rank_info: RankInfo = self._runner.info()
        """What this driver rank built; its KV cache is every rank's (the block count is agreed at start)."""
        self.replica_ranks: tuple[int, ...] = tuple(groups.replica_ranks)
        """Global ranks of this replica, its driver first."""
        self._closed = False

    @property
    def num_blocks(self) -> int:
        return self.rank_info.kv.num_blocks

    def draft_runner(self, config: EngineConfig, tokens: int) -> DraftRunner:
        """A draft model's runner (speculative decoding) on this driver rank's device, alone, its KV pool holding
        `tokens` tokens (cpllm/worker/draft_runner.py)."""
        return DraftRunner(config, self._runner.device, tokens)

    def rank_stats(self) -> RankStats:
        """This driver rank's step counters (by prefill strategy, by plan, fused and compiled decode steps); the
        replica's ranks run every step alike."""
        return self._runner.stats()

    def failed_pulls(self) -> dict[str, str]:
        """The last step's K/V pulls (cpllm/disagg) that failed on any rank of the replica: request id -> why."""
        transfer = self._runner.kv_transfer
        return dict(transfer.failed) if transfer is not None else {}

    def close_kv_row_server(self) -> None:
        """The driver rank's K/V row server (cpllm/disagg) stops answering while its control port lives: what a
        prefill instance that loses its rank mid-transfer looks like to a consumer (the fault tests' drill)."""
        if self._runner.kv_transfer is None:
            raise ValueError("close_kv_row_server: this instance has no --kv-transfer-config")
        self._runner.kv_transfer.server.close()

    def _watch(self):
        """Turns a dead spawned worker into an error naming its rank (torchrun watches its own processes)."""
        return self.workers.watch() if self.workers is not None else contextlib.nullcontext()

    def execute(self, step: SchedulerOutput) -> torch.Tensor | None:
        with self._watch():
            broadcast_object(step, src=self._groups.replica_driver, group=self._groups.replica_group)
            return self._runner.execute(step)

    def shutdown(self) -> None:
        """Stop this replica's workers (the shutdown step), then wait for the processes this driver spawned."""
        if self._closed:
            return
        self._closed = True
        if self._runner.kv_transfer is not None:  # the driver rank's row server (cpllm/disagg) unbinds its port
            self._runner.kv_transfer.close()
        try:
            if self._groups.replica_size > 1:
                with self._watch():
                    broadcast_object(SchedulerOutput(step_id=-1, shutdown=True), src=self._groups.replica_driver,
                                     group=self._groups.replica_group)
            if self.workers is not None:
                self.workers.join(self.config.parallel.distributed_timeout_s)
        finally:
            if self.workers is not None:
                self.workers.terminate_all()
            shutdown_distributed()
