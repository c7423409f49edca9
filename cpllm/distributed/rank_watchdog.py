"""Seeing a hung rank: every step the driver runs has a deadline, and a rank that stops making progress is named.

A rank that dies closes its sockets, so the driver's collectives fail at once (rank_processes.py). A rank that is
alive but makes no progress (stopped by SIGSTOP, swapped out, deadlocked) closes nothing: a collective inside a step
times out after --distributed-timeout, but the step broadcast waits without a limit (an idle engine may send the
next step hours later), so a rank stopped while idle would hang the next step for good. The watchdog closes that
gap: a thread that wakes every POLL_S and, once a step has run past its deadline, records a diagnosis (each rank's
process state, what the driver's thread was waiting in) and kills the ranks that stalled it, so the driver's wait
fails at once and the step raises with the diagnosis. The same facts answer /health while nothing is overdue yet:
a rank that is stopped or dead makes its replica unhealthy at once.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable

POLL_S = 0.25
"""How often the watchdog looks at the step in flight."""

STOPPED_STATES = {"T": "stopped by a signal (SIGSTOP)", "t": "stopped by a debugger"}
"""Process states (/proc/PID/stat) of a rank that cannot make progress until someone continues it."""


def process_state(pid: int) -> str | None:
    """The kernel's one-letter state of `pid` (R, S, D, T, t, Z, ...), or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def stopped(pid: int) -> str | None:
    """Why `pid` cannot run (stopped by a signal or a debugger), or None."""
    return STOPPED_STATES.get(process_state(pid) or "")


def waiting_in(thread_id: int | None) -> str:
    """Where thread `thread_id` is blocked: its innermost cpllm frame, with the collective's name if it has one."""
    frame = sys._current_frames().get(thread_id) if thread_id is not None else None
    while frame is not None:
        path = frame.f_code.co_filename
        if f"{os.sep}cpllm{os.sep}" in path:
            what = frame.f_locals.get("what")
            where = f"{path.rsplit(os.sep + 'cpllm' + os.sep, 1)[1]}:{frame.f_code.co_name}"
            return where + (f" ({what})" if isinstance(what, str) else "")
        frame = frame.f_back
    return "a call outside cpllm (a torch.distributed collective)"


class StepWatchdog:
    """Deadline of the step in flight on the driver; calls `on_overdue(seconds)` once a step runs past it."""

    def __init__(self, deadline_s: float, on_overdue: Callable[[float, str], None]):
        self.deadline_s = deadline_s
        self._on_overdue = on_overdue
        self._started: float | None = None
        self._thread_id: int | None = None
        self._fired = False
        self._closed = threading.Event()
        threading.Thread(target=self._loop, name="cpllm-step-watchdog", daemon=True).start()

    def begin(self) -> None:
        """A step starts on this thread."""
        self._thread_id = threading.get_ident()
        self._fired = False
        self._started = time.monotonic()

    def end(self) -> None:
        self._started = None

    def running_for(self) -> float | None:
        """Seconds the step in flight has run, or None between steps."""
        started = self._started
        return None if started is None else time.monotonic() - started

    def overdue(self) -> float | None:
        """Seconds the step in flight has run when that is past the deadline, else None."""
        running = self.running_for()
        return running if running is not None and running > self.deadline_s else None

    def close(self) -> None:
        self._closed.set()

    def _loop(self) -> None:
        while not self._closed.wait(POLL_S):
            running = self.overdue()
            if running is not None and not self._fired:
                self._fired = True
                self._on_overdue(running, waiting_in(self._thread_id))


def kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
