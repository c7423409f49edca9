"""The fault schedule of benchmarks/soak.py: kill or stop a rank of each DP replica in turn, watch the replicas.

Every `every_s` seconds the injector picks the next replica (0, 1, 0, ...) and, while it serves, sends one of its
ranks (its driver or a worker it spawned, at random) SIGKILL or SIGSTOP, alternating per replica. The monitor polls
/health every 0.1 s and keeps each replica's state, so each fault gets a detection time (until that replica leaves
"serving") and a recovery time (until it serves again).
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import threading
import time

import httpx
import psutil


@dataclasses.dataclass
class Fault:
    at: float
    """time.monotonic() when it was injected."""
    replica: int
    kind: str
    """"kill" (SIGKILL) or "stop" (SIGSTOP)."""
    pid: int
    rank: str
    """"driver" or "worker"."""
    detected: float | None = None
    recovered: float | None = None


def replica_ranks(server_pid: int) -> dict[int, list[int]]:
    """Replica index -> pids of its ranks, driver first (the server's children run rank_entry INDEX)."""
    found: dict[int, list[int]] = {}
    for child in psutil.Process(server_pid).children():
        try:
            cmd = child.cmdline()
            if "cpllm.distributed.rank_entry" not in cmd or child.status() == psutil.STATUS_ZOMBIE:
                continue
            index = int(cmd[cmd.index("cpllm.distributed.rank_entry") + 1])
            found[index] = [child.pid, *(p.pid for p in child.children(recursive=True))]
        except (psutil.Error, ValueError):
            continue
    return found


class FaultSchedule:
    """Injector and monitor threads for one soak run."""

    def __init__(self, url: str, server_pid: int, every_s: float, seed: int):
        self.url, self.server_pid, self.every_s = url, server_pid, every_s
        self.rng = random.Random(seed)
        self.faults: list[Fault] = []
        self.timeline: list[tuple[float, dict[int, str]]] = []
        """(time, replica -> state) every poll."""
        self._stop = threading.Event()
        """Set: no more faults."""
        self._watching = threading.Event()
        """Cleared: the monitor stops."""
        self._watching.set()
        self._threads = [threading.Thread(target=self._inject, daemon=True),
                         threading.Thread(target=self._monitor, daemon=True)]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self, settle_s: float = 180.0) -> None:
        """No more faults; the monitor keeps watching until every fault was seen and its replica serves again (or
        `settle_s` passes)."""
        self._stop.set()
        self._threads[0].join(10)
        deadline = time.monotonic() + settle_s
        while time.monotonic() < deadline and any(f.recovered is None for f in self.faults):
            time.sleep(0.1)
        self._watching.clear()
        self._threads[1].join(10)

    def states(self) -> dict[int, str]:
        try:
            body = httpx.get(f"{self.url}/health", timeout=2).json()
            return {r["replica"]: r["state"] for r in body["replicas"]}
        except (httpx.HTTPError, ValueError, KeyError):
            return {}

    def _monitor(self) -> None:
        while self._watching.is_set():
            time.sleep(0.1)
            now, states = time.monotonic(), self.states()
            self.timeline.append((now, states))
            for fault in list(self.faults):
                if now < fault.at:
                    continue
                state = states.get(fault.replica)
                if fault.detected is None and state not in (None, "serving"):
                    fault.detected = now
                elif fault.detected is not None and fault.recovered is None and state == "serving":
                    fault.recovered = now

    def _inject(self) -> None:
        count = 0
        while not self._stop.wait(self.every_s):
            ranks = replica_ranks(self.server_pid)
            replica = count % max(1, len(ranks))
            if self.states().get(replica) != "serving" or replica not in ranks:
                continue  # still recovering from the last fault: wait for the next slot
            kind = "kill" if (count // max(1, len(ranks))) % 2 == 0 else "stop"
            pid = self.rng.choice(ranks[replica])
            os.kill(pid, signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
            self.faults.append(Fault(time.monotonic(), replica, kind, pid,
                                     "driver" if pid == ranks[replica][0] else "worker"))
            count += 1

    def degraded(self, t: float) -> bool:
        """Whether some replica was not serving at time t (by the nearest earlier sample)."""
        state = {}
        for when, states in self.timeline:
            if when > t:
                break
            state = states
        return any(s != "serving" for s in state.values())

    def summary(self, completions: list[tuple[float, int]], start: float, end: float) -> dict:
        """Detection and recovery times, and output tokens/s with every replica serving and with one out."""
        detect = [f.detected - f.at for f in self.faults if f.detected is not None]
        recover = [f.recovered - f.at for f in self.faults if f.recovered is not None]
        tokens = {"healthy": 0, "degraded": 0}
        for when, count in completions:
            tokens["degraded" if self.degraded(when) else "healthy"] += count
        seconds = {"healthy": 0.0, "degraded": 0.0}
        for (t0, states), (t1, _) in zip(self.timeline, self.timeline[1:]):
            if start <= t0 <= end:
                seconds["degraded" if any(s != "serving" for s in states.values()) else "healthy"] += t1 - t0

        def stats(values):
            return {"mean": round(sum(values) / len(values), 2), "max": round(max(values), 2)} if values else None

        return {
            "every_s": self.every_s,
            "injected": [{"replica": f.replica, "kind": f.kind, "rank": f.rank,
                          "detect_s": round(f.detected - f.at, 2) if f.detected else None,
                          "recover_s": round(f.recovered - f.at, 2) if f.recovered else None} for f in self.faults],
            "detect_s": stats(detect), "recover_s": stats(recover),
            "undetected": sum(f.detected is None for f in self.faults),
            "unrecovered": sum(f.recovered is None for f in self.faults),
            "seconds": {k: round(v, 1) for k, v in seconds.items()},
            "output_tokens_per_s": {k: round(tokens[k] / seconds[k], 1) if seconds[k] else None for k in tokens},
        }
