"""Starting the ranks: torchrun, or one driver that spawns its workers (DESIGN section 1).

Both paths end in `init_distributed`, so the rest of the engine cannot tell them
apart. Failure handling, so a dead rank never leaves the driver waiting forever:

* every collective is bounded by `timeout_s` (given to init_process_group and
  new_group); a peer that died closes its sockets, so gloo usually fails at once;
* the driver polls its workers (`WorkerHandles.check_alive`, or `watch()` around
  each step) and turns a failure into a RuntimeError naming the dead rank and its
  exit code, then terminates the other workers;
* workers are non-daemonic (they may start processes of their own) and each
  watches its parent: when the driver dies, even by SIGKILL, they exit at once;
  an atexit hook in the driver terminates any still running.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from multiprocessing import connection, parent_process
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cpllm.config import ParallelConfig
from cpllm.distributed.groups import ParallelGroups

PARENT_DIED_EXIT_CODE = 75
"""Exit status of a spawned worker that stopped because its driver went away."""

DEATH_GRACE_S = 2.0
"""After a failed collective, how long the driver waits for a dying peer to be reaped."""


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
) -> ParallelGroups:
    """Join the process group as `rank` and build every parallel group.

    A world of one initialises nothing and returns `ParallelGroups.single()`.
    With NCCL, this process's GPU is its local rank (LOCAL_RANK, else rank).
    """
    if world_size != parallel.world_size:
        raise ValueError(
            f"{world_size} processes started but DP={parallel.data_parallel_size} x "
            f"PCP={parallel.prefill_context_parallel_size} x TP={parallel.tensor_parallel_size} "
            f"needs {parallel.world_size}"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is outside the world of size {world_size}")
    if world_size == 1:
        return ParallelGroups.single()
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    backend = backend or choose_backend(local_world)
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    host = f"[{master_addr}]" if ":" in master_addr else master_addr  # IPv6 literal
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{host}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    return ParallelGroups.build(parallel, timeout_s=timeout_s)


def shutdown_distributed() -> None:
    """Leave the process group (a no-op when none was started)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def _exit_when_parent_dies() -> None:
    parent = parent_process()
    if parent is None:
        return

    def watch() -> None:
        connection.wait([parent.sentinel])  # ready once the parent process has exited
        os._exit(PARENT_DIED_EXIT_CODE)

    threading.Thread(target=watch, name="cpllm-parent-watch", daemon=True).start()


def _worker_entry(
    worker_fn: Callable[..., None], rank: int, args: tuple, env: dict[str, str]
) -> None:
    os.environ.update(env)
    _exit_when_parent_dies()
    try:
        worker_fn(rank, *args)
    except SystemExit:
        raise
    except BaseException:
        # Print with the rank so the driver's log says who failed, then exit non-zero.
        print(f"cpllm worker rank {rank} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        os._exit(1)


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class WorkerHandles:
    """The driver's view of the workers it spawned (global ranks 1..world-1)."""

    def __init__(self, processes: dict[int, Any]) -> None:
        self.processes = processes
        """Global rank -> multiprocessing.Process."""
        atexit.register(self.terminate_all)

    @property
    def pids(self) -> dict[int, int]:
        return {rank: proc.pid for rank, proc in self.processes.items()}

    def dead_ranks(self) -> dict[int, int]:
        """Rank -> exit code of every worker that is no longer running."""
        return {rank: proc.exitcode for rank, proc in self.processes.items() if proc.exitcode is not None}

    def check_alive(self) -> None:
        """Raise RuntimeError naming each worker that has exited, with its exit status."""
        dead = self.dead_ranks()
        if dead:
            raise RuntimeError(self._describe(dead))

    def wait_for_any_exit(self, timeout_s: float) -> None:
        """Block until some worker exits or `timeout_s` passes."""
        alive = {proc.sentinel: proc for proc in self.processes.values() if proc.exitcode is None}
        if not alive:
            return
        for sentinel in connection.wait(list(alive), timeout=timeout_s):
            # The sentinel fires while the child closes its files, a moment before the
            # kernel lets it be reaped; join (a blocking waitpid) so exitcode is set.
            alive[sentinel].join(timeout_s)

    def join(self, timeout_s: float) -> None:
        """Wait for every worker to exit; raise if one fails or outlives the timeout.

        The timeout is the whole wait's budget (shared by all workers).
        """
        deadline = _Deadline(timeout_s)
        for proc in self.processes.values():
            proc.join(deadline.left())
        running = [rank for rank, proc in self.processes.items() if proc.exitcode is None]
        if running:
            self.terminate_all()
            raise RuntimeError(
                f"worker ranks {running} were still running after {timeout_s}s; terminated them"
            )
        failed = {rank: code for rank, code in self.dead_ranks().items() if code != 0}
        atexit.unregister(self.terminate_all)
        if failed:
            raise RuntimeError(
                "; ".join(
                    f"worker rank {rank} {_describe_exit(code)}" for rank, code in sorted(failed.items())
                )
            )

    def terminate_all(self, grace_s: float = 5.0) -> None:
        """SIGTERM every live worker, SIGKILL those still alive after `grace_s`, reap all."""
        for proc in self.processes.values():
            if proc.exitcode is None:
                proc.terminate()
        deadline = _Deadline(grace_s)
        for proc in self.processes.values():
            proc.join(deadline.left())
        for proc in self.processes.values():
            if proc.exitcode is None:
                proc.kill()
                proc.join()

    @contextlib.contextmanager
    def watch(self) -> Iterator[None]:
        """Run a step (collectives included) so a dead worker surfaces as a clear error.

        Before and after the block every worker must be alive. If the block raises
        (a gloo error from a dead peer, a timeout), the workers are terminated, since
        the others are stuck in collectives that cannot finish, and the error
        names the dead worker when there is one.
        """
        self.check_alive()
        try:
            yield
        except BaseException as exc:
            # A peer's closed socket can be seen a moment before its exit is reaped.
            if not self.dead_ranks():
                self.wait_for_any_exit(DEATH_GRACE_S)
            dead = self.dead_ranks()
            self.terminate_all()
            if dead:
                raise RuntimeError(self._describe(dead)) from exc
            raise
        self.check_alive()

    def _describe(self, dead: dict[int, int]) -> str:
        return "; ".join(
            f"worker rank {rank} (pid {self.processes[rank].pid}) {_describe_exit(code)}"
            for rank, code in sorted(dead.items())
        )


class _Deadline:
    def __init__(self, seconds: float) -> None:
        self._end = time.monotonic() + seconds

    def left(self) -> float:
        return max(0.0, self._end - time.monotonic())


def spawn_workers(
    world_size: int,
    worker_fn: Callable[..., None],
    args: tuple,
    *,
    master_port: int,
    master_addr: str = "127.0.0.1",
) -> WorkerHandles:
    """Start ranks 1..world_size-1 as `worker_fn(rank, *args)`; the caller is rank 0.

    `worker_fn` must be importable by name (spawn start method). Each worker sees
    MASTER_ADDR / MASTER_PORT / LOCAL_RANK / LOCAL_WORLD_SIZE in its environment
    (but not RANK, so `is_torchrun()` stays False there).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = mp.get_context("spawn")
    processes: dict[int, Any] = {}
    handles = WorkerHandles(processes)
    for rank in range(1, world_size):
        env = {
            "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(master_port),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
        }
        proc = ctx.Process(
            target=_worker_entry,
            args=(worker_fn, rank, args, env),
            name=f"cpllm-worker-{rank}",
            daemon=False,
        )
        proc.start()
        processes[rank] = proc
    return handles
