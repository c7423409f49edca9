"""Start-up: `create_engine` runs on every process that builds an engine (`LLM`, the CLI, the server).

With spawned DP replicas it builds the front over their processes (cpllm/replica_process.py); otherwise the ranks
of one world start (cpllm/launch_ranks.py, the module that brings the driver side and the rank side together):
global rank 0 spawns ranks 1..world-1 on one machine (or joins under torchrun) and becomes the front; every other
rank serves steps until the front shuts the world down.
"""

from __future__ import annotations

import logging

from cpllm.config.engine import EngineConfig
from cpllm.distributed.launch import is_torchrun
from cpllm.engine.replica_front import ReplicaFront
from cpllm.launch_ranks import create_rank_engine
from cpllm.model.tokenization.tokenizer import Tokenizer
from cpllm.replica_process import replica_config, replica_main

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
    return create_rank_engine(config, tokenizer, threads_per_rank=threads_per_rank)


def _replica_front(config: EngineConfig, tokenizer: Tokenizer, threads_per_rank: int | None,
                   max_restarts: int) -> ReplicaFront:
    one = replica_config(config)
    level = logging.getLogger().getEffectiveLevel()

    def start(index: int, commands: str, front: str, incarnation: int) -> tuple:
        return replica_main, (one, commands, front, incarnation, threads_per_rank, level)

    return ReplicaFront(config, tokenizer, start, max_restarts=max_restarts)
