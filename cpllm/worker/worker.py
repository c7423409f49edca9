"""A plain worker rank: its device, and the loop that runs the steps its replica driver broadcasts."""

from __future__ import annotations

import torch

from cpllm.config.engine import EngineConfig
from cpllm.distributed.comm import broadcast_object
from cpllm.distributed.groups import ParallelGroups
from cpllm.worker.runner import ModelRunner


def device_for(groups: ParallelGroups) -> torch.device:
    if groups.backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if groups.backend is None and torch.cuda.is_available():
        return torch.device("cuda", 0)
    return torch.device("cpu")


def run_worker(config: EngineConfig, groups: ParallelGroups) -> None:
    """A non-driver rank: build its runner, then run the steps its replica driver sends until the shutdown step."""
    runner = ModelRunner(config, groups, device_for(groups))
    while True:
        step = broadcast_object(None, src=groups.replica_driver, group=groups.replica_group)
        if step.shutdown:
            return
        runner.execute(step)
