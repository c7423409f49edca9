"""One data-parallel replica as its own process: its engine, its ranks and its step loop, driven over ZeroMQ.

The front (cpllm/engine/data_parallel.py) starts this in a fresh interpreter (`cpllm.distributed.rank_entry`)
for each replica, and again for each restart. The replica builds an engine of one replica (DP = 1), which spawns
the replica's own ranks and process groups, so nothing it shares with another replica can break: a replica that
fails takes only itself down. Its loop: apply the front's commands, run one step, report the outputs and its state;
while idle, report its state every HEARTBEAT_S, so that the front sees a replica that stopped making progress.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time

from cpllm.config.engine import EngineConfig
from cpllm.engine.replica_link import ReplicaInfo, ReplicaLink, ReplicaState
from cpllm.launch_ranks import create_rank_engine
from cpllm.model.tokenization.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

HEARTBEAT_S = 0.5
"""An idle replica reports its state this often (a busy one after every step)."""


def replica_config(config: EngineConfig) -> EngineConfig:
    """The config of one replica of a data-parallel config: the same, with DP = 1."""
    return dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, data_parallel_size=1))


def replica_main(index: int, config: EngineConfig, commands_address: str, front_address: str, incarnation: int,
                 threads_per_rank: int | None, log_level: int) -> None:
    """Entry point of replica `index` (run by rank_entry; `config` already has DP = 1)."""
    logging.basicConfig(level=log_level, format=f"%(levelname)s replica {index}: %(name)s: %(message)s")
    link = ReplicaLink(commands_address, front_address, index, incarnation)
    engine = None
    try:
        engine = create_rank_engine(config, load_tokenizer(config.model_path), threads_per_rank=threads_per_rank)
        workers = engine.executor.workers
        if workers is not None:
            workers.arm_watchdog(config.parallel.distributed_timeout_s)
        pids = (os.getpid(), *(workers.pids.values() if workers is not None else ()))
        link.send("ready", ReplicaInfo(engine.max_model_len, engine.kv_capacity_tokens, tuple(pids),
                                       getattr(engine, "_capacity_bounds_length", True)))
        _serve(engine, link, workers)
    except BaseException as exc:
        link.send("failed", f"{exc}")
        raise
    finally:
        try:
            if engine is not None:
                engine.shutdown()
        finally:
            link.close()


def _state(engine, workers) -> ReplicaState:
    return ReplicaState(running=engine.num_running, waiting=engine.num_waiting, kv_usage=engine.kv_cache_usage,
                        totals=engine.scheduler_totals, strategy_counts=engine.executor.rank_stats().strategy_counts,
                        problems=tuple(workers.problems()) if workers is not None else ())


def _serve(engine, link: ReplicaLink, workers) -> None:
    last_report = 0.0
    while True:
        busy = engine.has_unfinished_requests()
        for command in link.receive(0.0 if busy else HEARTBEAT_S):
            kind = command[0]
            if kind == "stop":
                return
            if kind == "abort":
                engine.abort_request(command[1])
                continue
            _, request_id, prompt_ids, params, prompt, arrival = command
            try:
                engine.add_request(request_id, prompt_ids, params, prompt=prompt, arrival_time=arrival)
            except ValueError as exc:  # the front checked the same limits: only a race (a reused id) gets here
                link.send("refused", request_id, str(exc))
        outputs = engine.step() if engine.has_unfinished_requests() else []
        now = time.monotonic()
        if outputs or now - last_report >= HEARTBEAT_S:
            link.send("outputs", outputs, _state(engine, workers))
            last_report = now
