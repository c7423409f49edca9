"""The front's handle on one data-parallel replica process: start, watch, kill, restart with backoff, report.

States: "starting" (its process is up, its engine not yet ready), "serving", "failed" (killed; a restart is due at
`next_start`, or none is left). A replica is in rotation only while serving with no rank stopped.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable

from cpllm.distributed.rank_processes import RankProcess, describe_exit, start_process
from cpllm.distributed.rank_watchdog import process_state, stopped
from cpllm.engine.replica_link import FrontLink, ReplicaHealth, ReplicaInfo, ReplicaState

logger = logging.getLogger(__name__)

RESTART_BACKOFF_S = 1.0
"""Delay before a failed replica's first restart; it doubles with each further restart."""
RESTART_BACKOFF_MAX_S = 30.0
"""Longest delay between a failure and the restart."""


def restart_delay(restarts_so_far: int) -> float:
    return min(RESTART_BACKOFF_MAX_S, RESTART_BACKOFF_S * 2**restarts_so_far)


class ReplicaHandle:
    """One replica: its process (its driver; the driver spawns its other ranks), its command socket, its state."""

    def __init__(self, index: int, link: FrontLink, start: Callable[[int, str, int], tuple]):
        self.index = index
        self.link = link
        self._start_args = start
        """(index, commands address, incarnation) -> (function, args) of the replica process."""
        self.incarnation = 0
        self.process: RankProcess | None = None
        self.socket = None
        self.state = "failed"
        self.info: ReplicaInfo | None = None
        self.report = ReplicaState()
        """Its latest state report."""
        self.last_seen = time.monotonic()
        self.started_at = time.monotonic()
        self.failed_at: float | None = None
        self.restarts = 0
        self.failures = 0
        self.next_start: float | None = None
        """When a failed replica is started again (None: not scheduled, e.g. no restart left)."""
        self.reason: str | None = None
        """Why it last failed."""
        self.unhealthy_since: float | None = None
        """Since when a rank of this serving replica has been stopped or dead (None: all well)."""

    # ---- life --------------------------------------------------------------------------------------------

    def start(self) -> None:
        self.incarnation += 1
        self.socket, address = self.link.command_socket()
        function, args = self._start_args(self.index, address, self.incarnation)
        self.process = start_process(self.index, function, args, {})
        self.state, self.info, self.report = "starting", None, ReplicaState()
        self.unhealthy_since = None
        self.started_at = self.last_seen = time.monotonic()
        self.next_start = None

    def ready(self, info: ReplicaInfo) -> None:
        self.info, self.state, self.last_seen = info, "serving", time.monotonic()

    def send(self, command: tuple) -> None:
        self.link.send(self.socket, command)

    def kill(self, ranks: bool = True) -> None:
        """SIGKILL the driver and (`ranks`) every other rank it reported, since a stopped rank would not see its
        driver go; then reap the driver. A driver that stopped cleanly has reaped its ranks: their pids are not
        signalled then (they may belong to someone else by now)."""
        if self.process is not None and self.process.exitcode is None:
            self.process.kill()
        for pid in (self.info.pids[1:] if ranks and self.info is not None else ()):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.process is not None:
            self.process.join(5.0)
            self.process.read_control()
            self.process.close()
        if self.socket is not None:
            self.socket.close(linger=0)
            self.socket = None

    def stop(self) -> None:
        """Ask a live replica to finish (its engine stops its ranks), without waiting."""
        if self.state in ("serving", "starting") and self.socket is not None:
            self.send(("stop",))

    def join(self, timeout_s: float) -> None:
        if self.process is not None and self.process.exitcode is None:
            self.process.join(timeout_s)
        self.kill(ranks=self.process is None or self.process.exitcode != 0)

    # ---- what is wrong ----------------------------------------------------------------------------------

    def exit_problem(self) -> str | None:
        """Why its driver process is gone (with its last error), or None while it runs."""
        if self.process is None or self.process.exitcode is None:
            return None
        self.process.read_control()
        error = (self.process.last_error or "").strip().splitlines()
        last = f": {error[-1]}" if error else ""
        return f"replica {self.index}'s driver (pid {self.process.pid}) {describe_exit(self.process.exitcode)}{last}"

    def silent_problem(self, limit_s: float) -> str | None:
        """Why a replica that sent nothing for longer than `limit_s` is hung, or None."""
        quiet = time.monotonic() - self.last_seen
        if self.state != "serving" or quiet <= limit_s:
            return None
        pid = self.process.pid
        why = stopped(pid)
        state = f"is {why}" if why else f"is in state {process_state(pid)}"
        return (f"replica {self.index}'s driver (pid {pid}) {state} and sent nothing for {quiet:.1f} s "
                f"(deadline {limit_s:g} s: --distributed-timeout plus the heartbeat)")

    def live_problems(self) -> list[str]:
        """Its ranks stopped now (checked here, so a stopped driver shows too), plus what it last reported."""
        if self.state != "serving":
            return []
        pids = self.info.pids if self.info is not None else ()
        found = [f"rank {i} of replica {self.index} (pid {pid}) is {why}"
                 for i, pid in enumerate(pids) if (why := stopped(pid)) is not None]
        return found + [f"replica {self.index}: {p}" for p in self.report.problems]

    def takes_requests(self) -> bool:
        return self.state == "serving" and not self.live_problems()

    def health(self) -> ReplicaHealth:
        if self.state == "serving":
            problems = tuple(self.live_problems())
            return ReplicaHealth(self.index, "unhealthy" if problems else "serving", problems, self.restarts)
        reason = (self.reason,) if self.reason else ()
        if self.state == "starting" or self.next_start is not None:
            return ReplicaHealth(self.index, "restarting", reason, self.restarts)
        return ReplicaHealth(self.index, "failed", reason, self.restarts)
