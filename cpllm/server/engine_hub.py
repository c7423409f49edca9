"""The engine's side of `cpllm serve --api-server-count N`: one engine, its step loop, N API-server clients.

The engine process (the one `cpllm serve` started, which also spawned the engine's ranks) runs this loop instead
of the HTTP front: it takes requests and aborts from every API-server process, steps the engine, and sends each
request's outputs back to the process that asked for it, with the engine's state, so that each API server's
/health and /metrics read the same engine. The channel is replica_link's, with the roles of a DP front and its
replicas: the hub binds one PULL that every client's PUSH connects to (tagged with the client's index) and one
PUSH per client. A send to a client never blocks (a client that is gone simply misses its messages).
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import time
from collections.abc import Callable

import zmq

from cpllm.engine.engine import SchedulerTotals
from cpllm.engine.replica_link import FrontLink, ReplicaHealth

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05
"""Longest wait for a client's command while no request runs (how quickly a stop or a dead client is seen)."""
HEARTBEAT_S = 0.5
"""While idle, the hub sends every client the engine's state this often (so a client sees a dead engine)."""


@dataclasses.dataclass(kw_only=True, frozen=True, slots=True)
class EngineReport:
    """The engine's figures an API-server process shows in /health and /metrics."""

    running: int = 0
    """Sequences its scheduler(s) run."""
    waiting: int = 0
    """Sequences waiting to be scheduled (and, with DP, accepted ones no replica took yet)."""
    kv_usage: float = 0.0
    """Fraction of the KV blocks in use."""
    rank_kv_usage: dict = dataclasses.field(default_factory=dict)
    """Global rank -> fraction of its KV blocks in use."""
    totals: SchedulerTotals = dataclasses.field(default_factory=SchedulerTotals)
    """Preemptions and prefix-cache queries and hits since start."""
    strategy_counts: dict = dataclasses.field(default_factory=dict)
    """Prompt steps by context-parallel prefill strategy (empty without PCP)."""
    replicas: tuple[ReplicaHealth, ...] = ()
    """Each replica's health (one entry without DP)."""
    requeued: int = 0
    """DP requests moved to another replica before their first token."""
    ended_by_failure: int = 0
    """DP requests ended with an error because their replica failed after they had sent tokens."""


@dataclasses.dataclass(kw_only=True, frozen=True, slots=True)
class HubAddresses:
    """Where an API-server process connects: its own command stream and the hub's shared inbox."""

    inbox: str
    """The hub's PULL: every client's requests, aborts and greetings."""
    clients: tuple[str, ...]
    """Client i's PULL connects here (the hub's PUSH for client i)."""


class EngineHub:
    """Serves one engine to N API-server processes over ZeroMQ until `should_stop()` says so."""

    def __init__(self, engine, num_clients: int):
        self.engine = engine
        self.link = FrontLink()
        self._sockets = [self.link.command_socket() for _ in range(num_clients)]
        self.addresses = HubAddresses(inbox=self.link.inbox_address,
                                      clients=tuple(address for _, address in self._sockets))
        self._greeted = [False] * num_clients
        """A client's PUSH is sent to only once it said hello (a bound PUSH without a peer would block)."""
        self._owner: dict[str, int] = {}
        executor = getattr(engine, "executor", None)  # a DP front has none: it reports per replica
        self._workers = getattr(executor, "workers", None)
        self._ranks = list(executor.replica_ranks) if executor is not None else []
        self._pcp = engine.config.parallel.prefill_context_parallel_size
        self._idle_tick = getattr(engine, "idle_tick_s", None) is not None
        if hasattr(engine, "collect_failures"):
            engine.collect_failures = True  # a DP replica's failure ends its started requests one by one

    def serve(self, should_stop: Callable[[], bool]) -> None:
        """The step loop; raises what the engine raised when it fails (after telling every client)."""
        if self._workers is not None and not hasattr(self.engine, "replica_health"):
            self._workers.arm_watchdog(self.engine.config.parallel.distributed_timeout_s)
        last_report = 0.0
        try:
            while not should_stop():
                busy = self.engine.has_unfinished_requests()
                for message in self.link.receive(0.0 if busy else IDLE_WAIT_S):
                    self._command(*message)
                outputs = self.engine.step() if busy or self.engine.has_unfinished_requests() or \
                    self._idle_tick else []
                now = time.monotonic()
                heartbeat = now - last_report >= HEARTBEAT_S
                self._deliver(outputs, heartbeat)
                if heartbeat:
                    last_report = now
        except BaseException as exc:
            logger.exception("engine step loop failed")
            self._broadcast(("dead", f"the engine failed: {exc}"))
            raise

    def close(self) -> None:
        self.link.close()

    # ---- commands --------------------------------------------------------------------------------------

    def _command(self, kind: str, client: int, _incarnation: int, *payload) -> None:
        if kind == "hello":
            self._greeted[client] = True
            self._send(client, ("outputs", [], self.report()))
        elif kind == "add":
            request_id, prompt_ids, params, prompt, arrival = payload
            try:
                self.engine.add_request(request_id, prompt_ids, params, prompt=prompt, arrival_time=arrival)
            except ValueError as exc:  # the client checked the same limits: a reused request id gets here
                self._send(client, ("failed", request_id, str(exc)))
                return
            self._owner[request_id] = client
        elif kind == "abort":
            if self._owner.get(payload[0]) == client:
                del self._owner[payload[0]]
                self.engine.abort_request(payload[0])
        elif kind == "bye":
            self._greeted[client] = False
            for request_id in [r for r, owner in self._owner.items() if owner == client]:
                del self._owner[request_id]
                self.engine.abort_request(request_id)

    # ---- outputs ---------------------------------------------------------------------------------------

    def _deliver(self, outputs: list, heartbeat: bool) -> None:
        """Each client's outputs of this step with the engine's state; every client gets the state on a
        heartbeat; requests the engine ended on a replica's failure go to their clients as failures."""
        batches: dict[int, list] = {}
        for output in outputs:
            client = self._owner.get(output.request_id)
            if client is None:
                continue
            batches.setdefault(client, []).append(output)
            if output.finished:
                del self._owner[output.request_id]
        for request_id, message in (self.engine.take_failures() if hasattr(self.engine, "take_failures") else ()):
            client = self._owner.pop(request_id, None)
            if client is not None:
                self._send(client, ("failed", request_id, message))
        if not batches and not heartbeat:
            return
        report = self.report()
        for client in range(len(self._sockets)):
            if client in batches or heartbeat:
                self._send(client, ("outputs", batches.get(client, []), report))

    def report(self) -> EngineReport:
        """The engine's state now (what AsyncEngine publishes in a single-process server)."""
        engine = self.engine
        if hasattr(engine, "rank_kv_usage"):  # every rank of every replica
            per_rank = engine.rank_kv_usage()
        else:  # one replica: its ranks share block ids
            per_rank = {rank: engine.kv_cache_usage for rank in self._ranks}
        if hasattr(engine, "replica_health"):
            replicas = tuple(engine.replica_health())
        else:
            problems = tuple(self._workers.problems()) if self._workers is not None else ()
            replicas = (ReplicaHealth(0, "unhealthy" if problems else "serving", problems),)
        counts = {}
        if self._pcp > 1:  # without PCP no step chooses a strategy
            counts = (engine.strategy_counts() if hasattr(engine, "strategy_counts")
                      else engine.executor.rank_stats().strategy_counts)
        return EngineReport(running=engine.num_running, waiting=engine.num_waiting, kv_usage=engine.kv_cache_usage,
                            rank_kv_usage=per_rank, totals=engine.scheduler_totals, strategy_counts=dict(counts),
                            replicas=replicas, requeued=getattr(engine, "requeued", 0),
                            ended_by_failure=getattr(engine, "ended_by_failure", 0))

    def _broadcast(self, message: tuple) -> None:
        for client in range(len(self._sockets)):
            self._send(client, message)

    def _send(self, client: int, message: tuple) -> None:
        if not self._greeted[client]:
            return
        try:
            self._sockets[client][0].send(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL),
                                          flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:  # its process is gone: nobody reads this any more
            self._greeted[client] = False
