"""Joining the world: under torchrun, or as the driver / a worker it spawned (docs/architecture.md "Starting ranks").

Both paths end in `init_distributed`, so the rest of the engine cannot tell them
apart. Every collective is bounded by `timeout_s` (given to init_process_group
and new_group); a peer that died closes its sockets, so gloo usually fails at
once. Spawned ranks meet in a TCP store the driver hosts: the driver waits for
each worker's joined key while watching the worker processes
(`rank_processes.WorkerHandles.wait_joined`), so a worker that fails to start is
reported with its own error at once, not as a store timeout.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from cpllm.config.engine import ParallelConfig
from cpllm.distributed.groups import ParallelGroups
from cpllm.distributed.rank_processes import WorkerHandles, joined_key


JOIN_TIMEOUT_S = 300.0
"""How long the driver waits for its spawned ranks to join (at least; --distributed-timeout when longer)."""


def is_torchrun() -> bool:
    """True when this process was started by torchrun (or anything setting its env vars)."""
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def torchrun_env() -> dict[str, Any]:
    """rank, world_size, master_addr and master_port as torchrun set them."""
    return {
        "rank": int(os.environ["RANK"]),
        "world_size": int(os.environ["WORLD_SIZE"]),
        "master_addr": os.environ["MASTER_ADDR"],
        "master_port": int(os.environ.get("MASTER_PORT", "29500")),
    }


def find_free_port() -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def choose_backend(local_world_size: int) -> str:
    """NCCL when this node has a GPU for each of its ranks, gloo otherwise."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_world_size:
        return "nccl"
    return "gloo"


def init_distributed(
    parallel: ParallelConfig,
    *,
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    timeout_s: float,
    backend: str | None = None,
    workers: WorkerHandles | None = None,
) -> ParallelGroups:
    """Join the process group as `rank` and build every parallel group.

    A world of one initialises nothing and returns `ParallelGroups.single(parallel.dims)`.
    Outside torchrun, rank 0 hosts the TCP store at `master_port`; given the
    `workers` it spawned, it waits for them to join (failing fast on a dead one)
    before it enters the process group. With NCCL, this process's GPU is its
    local rank (LOCAL_RANK, else rank).
    """
    if world_size != parallel.dims.world_size:
        raise ValueError(
            f"{world_size} processes started but DP={parallel.data_parallel_size} x "
            f"PCP={parallel.prefill_context_parallel_size} x TP={parallel.tensor_parallel_size} "
            f"needs {parallel.dims.world_size}"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is outside the world of size {world_size}")
    if world_size == 1:
        return ParallelGroups.single(parallel.dims)
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    backend = backend or choose_backend(local_world)
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    timeout = timedelta(seconds=timeout_s)
    if is_torchrun():
        host = f"[{master_addr}]" if ":" in master_addr else master_addr  # IPv6 literal
        dist.init_process_group(backend=backend, init_method=f"tcp://{host}:{master_port}", rank=rank,
                                world_size=world_size, timeout=timeout)
    else:
        store = _join_store(rank, world_size, master_addr, master_port, timeout, workers)
        dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    return ParallelGroups.build(parallel, timeout_s=timeout_s)


def _join_store(rank: int, world_size: int, master_addr: str, master_port: int, timeout: timedelta,
                workers: WorkerHandles | None) -> dist.TCPStore:
    """Rank 0 hosts the store and (with its workers' handles) waits for all to join; others connect and say so."""
    store = dist.TCPStore(master_addr, master_port, world_size, is_master=rank == 0, timeout=timeout,
                          wait_for_workers=False)
    if rank != 0:
        store.set(joined_key(rank), "1")
    elif workers is not None:
        # Starting a rank (a fresh interpreter importing torch) takes seconds on a loaded host and has nothing to do
        # with --distributed-timeout; a worker that fails to start is reported at once whatever this bound is.
        workers.wait_joined(store, max(timeout.total_seconds(), JOIN_TIMEOUT_S))
    return store


def shutdown_distributed() -> None:
    """Leave the process group (a no-op when none was started)."""
    if dist.is_initialized():
        dist.destroy_process_group()
