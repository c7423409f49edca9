"""The driver's side of the ranks it starts on one machine: spawn, watch, report, stop.

Each worker is a fresh interpreter running `cpllm.distributed.rank_entry` (never
multiprocessing's spawn, which re-runs the user's `__main__`). Failure handling,
so a dead rank never leaves the driver waiting:

* start-up: the driver waits for every worker to join its store while reading
  their control pipes, so a worker that fails to import or to start is reported
  within moments with its own traceback (`WorkerHandles.wait_joined`);
* at run time: `watch()` around each step turns a failed collective into an
  error naming the dead rank, its exit status and its last error;
* a rank that stops making progress (SIGSTOP, a deadlock): once armed, the step
  watchdog (rank_watchdog.py) gives every step a deadline, names the stalled
  rank, its pid and what the driver waited in, and ends the ranks so the step
  fails instead of hanging; `problems()` tells /health the same at any time;
* workers watch the driver through their stdin: when it dies, even by SIGKILL,
  they exit at once; an atexit hook in the driver terminates any still running.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pickle
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from multiprocessing import connection

from cpllm.distributed.rank_entry import write_frame
from cpllm.distributed.rank_watchdog import StepWatchdog, kill, process_state, stopped

DEATH_GRACE_S = 2.0
"""After a failed collective, how long the driver waits for a dying peer to be reaped."""

POLL_S = 0.05
"""How often the driver looks at its workers while it waits for them to join."""


def joined_key(rank: int) -> str:
    """Store key a spawned rank sets once it is connected to the driver's store."""
    return f"cpllm/joined/{rank}"


class RankProcess:
    """One spawned rank: its process, a pidfd that becomes readable when it exits, its control pipe."""

    def __init__(self, rank: int, popen: subprocess.Popen, control: connection.Connection):
        self.rank, self.popen, self.control = rank, popen, control
        self.sentinel = os.pidfd_open(popen.pid)
        self.last_error: str | None = None
        """Traceback the rank reported before it died, if it could."""

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def read_control(self) -> None:
        """Take every message waiting on the control pipe (non-blocking)."""
        if self.control.closed:
            return
        try:
            while self.control.poll(0):
                kind, text = self.control.recv()
                if kind == "error":
                    self.last_error = text
        except (EOFError, OSError):
            pass  # the rank has exited; its exit code tells the rest

    def join(self, timeout_s: float | None = None) -> None:
        try:
            self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass

    def terminate(self) -> None:
        self.popen.terminate()

    def close(self) -> None:
        """Release the pidfd and the pipes of a reaped rank (idempotent)."""
        if self.sentinel is not None:
            os.close(self.sentinel)
            self.sentinel = None
            self.control.close()
            if self.popen.stdin is not None:
                self.popen.stdin.close()

    def kill(self) -> None:
        self.popen.kill()

    def resume(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.popen.pid, signal.SIGCONT)


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class _Deadline:
    def __init__(self, seconds: float) -> None:
        self._end = time.monotonic() + seconds

    def left(self) -> float:
        return max(0.0, self._end - time.monotonic())


class WorkerHandles:
    """The driver's view of the workers it spawned (global ranks 1..world-1)."""

    def __init__(self, processes: dict[int, RankProcess]) -> None:
        self.processes = processes
        """Global rank -> its RankProcess."""
        self.watchdog: StepWatchdog | None = None
        """The deadline of each step, once armed (start-up, which loads the model, has none)."""
        self.failure: str | None = None
        """What the watchdog found when a step ran past its deadline (the error the step then raises)."""
        atexit.register(self.terminate_all)

    def arm_watchdog(self, deadline_s: float) -> None:
        """From now on a watched step that runs longer than `deadline_s` is diagnosed and its ranks are ended."""
        if self.watchdog is None:
            self.watchdog = StepWatchdog(deadline_s, self._overdue)

    def _stopped(self) -> dict[int, str]:
        """Rank -> why it cannot run, for every live worker that is stopped."""
        return {rank: why for rank, proc in self.processes.items()
                if proc.exitcode is None and (why := stopped(proc.pid)) is not None}

    def _describe_stopped(self, stalled: dict[int, str]) -> str:
        return "; ".join(f"worker rank {rank} (pid {self.processes[rank].pid}) is {why}"
                         for rank, why in sorted(stalled.items()))

    def _overdue(self, running_s: float, waiting_in: str) -> None:
        """The watchdog's verdict on a step past its deadline: name who stalled it, then end those ranks."""
        stalled = self._stopped()
        if stalled:
            who, victims = self._describe_stopped(stalled) + " and made no progress", list(stalled)
        else:
            states = ", ".join(f"rank {rank} pid {proc.pid} state {process_state(proc.pid)}"
                               for rank, proc in sorted(self.processes.items()))
            who, victims = f"no worker rank is stopped or dead ({states})", list(self.processes)
        self.failure = (f"{who}: the step waited {running_s:.1f} s in {waiting_in}, past the deadline of "
                        f"{self.watchdog.deadline_s:g} s (--distributed-timeout); the replica's ranks are ended")
        for rank in victims:
            kill(self.processes[rank].pid)  # the driver's wait then fails at once (closed sockets, dead pid)

    def problems(self) -> list[str]:
        """Why this replica cannot serve right now: ranks dead or stopped, a step past its deadline (for /health)."""
        found = [f"worker rank {rank} (pid {proc.pid}) {describe_exit(proc.exitcode)}"
                 for rank, proc in sorted(self.processes.items()) if proc.exitcode is not None]
        stalled = self._stopped()
        if stalled:
            found.append(self._describe_stopped(stalled))
        overdue = self.watchdog.overdue() if self.watchdog is not None else None
        if overdue is not None:
            found.append(f"a step has run {overdue:.1f} s, past the deadline of {self.watchdog.deadline_s:g} s "
                         "(--distributed-timeout)")
        return found

    @property
    def pids(self) -> dict[int, int]:
        return {rank: proc.pid for rank, proc in self.processes.items()}

    def dead_ranks(self) -> dict[int, int]:
        """Rank -> exit code of every worker that is no longer running."""
        return {rank: proc.exitcode for rank, proc in self.processes.items() if proc.exitcode is not None}

    def check_alive(self) -> None:
        """Raise RuntimeError naming each worker that has exited, with its exit status and error."""
        if self.failure is not None:
            raise RuntimeError(self.failure)
        dead = self.dead_ranks()
        if dead:
            raise RuntimeError(self._describe(dead))

    def wait_joined(self, store, timeout_s: float) -> None:
        """Block until every worker has set its joined key in `store`; raise at once if one fails first."""
        keys = [joined_key(rank) for rank in self.processes]
        deadline = _Deadline(timeout_s)
        watched = [p.sentinel for p in self.processes.values()] + [p.control for p in self.processes.values()]
        while not store.check(keys):
            for proc in self.processes.values():
                proc.read_control()
            if any(proc.exitcode is not None or proc.last_error is not None for proc in self.processes.values()):
                self.wait_for_reporters_exit(DEATH_GRACE_S)
                failed = {rank: proc.exitcode for rank, proc in self.processes.items()
                          if proc.exitcode is not None or proc.last_error is not None}
                self.terminate_all()
                raise RuntimeError("while starting: " + self._describe(failed))
            if deadline.left() == 0:
                self.terminate_all()
                missing = [rank for rank in self.processes if not store.check([joined_key(rank)])]
                raise RuntimeError(f"worker ranks {missing} did not join the driver within {timeout_s}s")
            connection.wait(watched, timeout=POLL_S)

    def wait_for_reporters_exit(self, timeout_s: float) -> None:
        """Give every rank that reported an error up to `timeout_s` (shared) to exit, so its code can be named."""
        deadline = _Deadline(timeout_s)
        for proc in self.processes.values():
            proc.read_control()
            if proc.last_error is not None:
                proc.join(deadline.left())

    def wait_for_any_exit(self, timeout_s: float) -> None:
        """Block until some worker exits or `timeout_s` passes."""
        alive = {proc.sentinel: proc for proc in self.processes.values() if proc.exitcode is None}
        if alive:
            for sentinel in connection.wait(list(alive), timeout=timeout_s):
                alive[sentinel].join(timeout_s)

    def join(self, timeout_s: float) -> None:
        """Wait for every worker to exit; raise if one fails or outlives the timeout (shared by all)."""
        deadline = _Deadline(timeout_s)
        for proc in self.processes.values():
            proc.join(deadline.left())
        running = [rank for rank, proc in self.processes.items() if proc.exitcode is None]
        if running:
            self.terminate_all()
            raise RuntimeError(f"worker ranks {running} were still running after {timeout_s}s; terminated them")
        failed = {rank: code for rank, code in self.dead_ranks().items() if code != 0}
        atexit.unregister(self.terminate_all)
        self._close_all()
        if failed:
            raise RuntimeError("; ".join(f"worker rank {rank} {describe_exit(code)}"
                                         for rank, code in sorted(failed.items())))

    def terminate_all(self, grace_s: float = 5.0) -> None:
        """SIGTERM every live worker, SIGKILL those still alive after `grace_s`, reap all."""
        for proc in self.processes.values():
            if proc.exitcode is None:
                proc.terminate()
                if stopped(proc.pid) is not None:
                    proc.resume()  # a stopped process acts on SIGTERM only once continued
        deadline = _Deadline(grace_s)
        for proc in self.processes.values():
            proc.join(deadline.left())
        for proc in self.processes.values():
            if proc.exitcode is None:
                proc.kill()
                proc.join()
        self._close_all()

    def _close_all(self) -> None:
        if self.watchdog is not None:
            self.watchdog.close()
        for proc in self.processes.values():
            proc.read_control()  # keep a last error for the report before the pipe goes
            proc.close()

    @contextlib.contextmanager
    def watch(self) -> Iterator[None]:
        """Run a step (collectives included) so a dead worker surfaces as a clear error.

        Before and after the block every worker must be alive. If the block raises
        (a gloo error from a dead peer, a timeout), the workers are terminated, since
        the others are stuck in collectives that cannot finish, and the error
        names the dead worker when there is one.
        """
        self.check_alive()
        dog = self.watchdog
        if dog is not None:
            dog.begin()
        try:
            yield
        except BaseException as exc:
            if dog is not None:
                dog.end()
            stalled = self._stopped()
            # A peer's closed socket can be seen a moment before its exit is reaped.
            if self.failure is None and not stalled and not self.dead_ranks():
                self.wait_for_any_exit(DEATH_GRACE_S)
            dead = self.dead_ranks()
            failure = self.failure
            if failure is None and stalled:
                failure = f"{self._describe_stopped(stalled)} and made no progress; the driver's wait failed: {exc}"
                self.failure = failure
            self.terminate_all()
            if failure is not None:
                raise RuntimeError(failure) from exc
            if dead:
                raise RuntimeError(self._describe(dead)) from exc
            raise
        if dog is not None:
            dog.end()
        self.check_alive()

    def _describe(self, failed: dict[int, int | None]) -> str:
        parts = []
        for rank, code in sorted(failed.items()):
            proc = self.processes[rank]
            proc.read_control()
            status = describe_exit(code) if code is not None else "reported an error"
            error = f":\n{proc.last_error.rstrip()}" if proc.last_error else ""
            parts.append(f"worker rank {rank} (pid {proc.pid}) {status}{error}")
        return "; ".join(parts)


def spawn_workers(
    world_size: int,
    worker_fn: Callable[..., None],
    args: tuple,
    *,
    master_port: int,
    master_addr: str = "127.0.0.1",
) -> WorkerHandles:
    """Start ranks 1..world_size-1 as `worker_fn(rank, *args)` in fresh interpreters; the caller is rank 0.

    `worker_fn` must be importable by name from a module other than `__main__`
    (the workers do not run the caller's script). Each worker sees MASTER_ADDR /
    MASTER_PORT / LOCAL_RANK / LOCAL_WORLD_SIZE in its environment (but not
    RANK, so `is_torchrun()` stays False there).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if getattr(worker_fn, "__module__", "__main__") == "__main__":
        raise ValueError(f"worker function {worker_fn!r} must live in an importable module, not in __main__")
    handles = WorkerHandles({})
    for rank in range(1, world_size):
        env = {"MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
               "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size)}
        handles.processes[rank] = start_process(rank, worker_fn, args, env)
    return handles


def start_process(rank: int, worker_fn: Callable[..., None], args: tuple, env: dict[str, str]) -> RankProcess:
    """`worker_fn(rank, *args)` in a fresh interpreter (rank_entry) with `env` added to this environment."""
    payload = pickle.dumps((worker_fn, args, env))  # before the process exists: a pickling error is the caller's
    read_fd, write_fd = os.pipe()
    popen = subprocess.Popen(
        [sys.executable, "-m", "cpllm.distributed.rank_entry", str(rank), str(write_fd)],
        stdin=subprocess.PIPE, pass_fds=(write_fd,), env={**os.environ, **env},
    )
    os.close(write_fd)  # only the child writes: its exit then reads as end of file here
    write_frame(popen.stdin, pickle.dumps(list(sys.path)))
    write_frame(popen.stdin, payload)
    popen.stdin.flush()  # stdin stays open: the worker reads its end of file as "the driver died"
    return RankProcess(rank, popen, connection.Connection(read_fd, writable=False))
