"""The channel between the data-parallel front and its replicas: ZeroMQ sockets on loopback, pickled messages.

Why ZeroMQ (pyzmq) and not the gloo group the replicas shared before: a gloo group binds its members for life, so
one replica's death breaks every collective on it ("Connection reset by peer") and a restarted replica cannot
join it again without rebuilding the whole world; its waits are one timeout for every member. A ZeroMQ socket
pairs the front with each replica separately: a dead peer costs nothing but its own queue, a restarted one simply
connects again, and every receive here is a poll with its own timeout. vLLM's DP coordinator uses it for the same
reasons; pyzmq is a self-contained wheel (libzmq bundled, no torch or CUDA).

Sockets: one PUSH per replica incarnation on the front (commands), bound to a fresh loopback port for each start, so
a restarted replica never reads what was meant for the one that died; one PULL on the front that every replica's
PUSH connects to (outputs, state, failures), each message tagged with the replica and its incarnation so the front
drops what a dead incarnation sent.
"""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any

import zmq

HOST = "127.0.0.1"


@dataclasses.dataclass(frozen=True, slots=True)
class ReplicaState:
    """What a replica reports after each step and, while idle, every heartbeat."""

    running: int = 0
    """Sequences its scheduler runs."""
    waiting: int = 0
    """Sequences waiting in its scheduler."""
    kv_usage: float = 0.0
    """Fraction of its KV blocks in use (every rank of the replica holds the same block ids)."""
    totals: Any = None
    """Its SchedulerTotals (preemptions, prefix-cache queries and hits since it started)."""
    strategy_counts: dict = dataclasses.field(default_factory=dict)
    """Prompt steps by context-parallel prefill strategy since it started."""
    problems: tuple[str, ...] = ()
    """Its ranks that are dead or stopped, or a step past its deadline (WorkerHandles.problems)."""


@dataclasses.dataclass(frozen=True, slots=True)
class ReplicaInfo:
    """Sent once a replica is ready: its limits (the same for every replica of one config) and its processes."""

    max_model_len: int
    kv_capacity_tokens: int
    pids: tuple[int, ...]
    """Process id of each of its ranks, its driver first."""
    capacity_bounds_length: bool = True
    """Whether its KV capacity bounds a request's length (False when sliding-window layers keep fewer positions)."""


@dataclasses.dataclass(frozen=True, slots=True)
class ReplicaHealth:
    """One data-parallel replica as the probes see it."""

    replica: int
    """Its index (0 .. DP-1)."""
    state: str
    """"serving", "unhealthy" (a rank dead or stopped, a step past its deadline), "restarting" or "failed"."""
    problems: tuple[str, ...] = ()
    """What is wrong, each naming the rank and its pid where one is to blame."""
    restarts: int = 0
    """Times this replica was restarted since the server started."""

    @property
    def serving(self) -> bool:
        return self.state == "serving"

    @property
    def recoverable(self) -> bool:
        return self.state in ("serving", "unhealthy", "restarting")

    def as_json(self) -> dict:
        return {"replica": self.replica, "state": self.state, "problems": list(self.problems),
                "restarts": self.restarts}


def _socket(context: zmq.Context, kind: int) -> zmq.Socket:
    sock = context.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)  # closing never waits for a peer that may be dead
    sock.setsockopt(zmq.SNDHWM, 0)  # never drop nor block on a burst of outputs
    sock.setsockopt(zmq.RCVHWM, 0)
    return sock


class FrontLink:
    """The front's sockets: one PULL for everything the replicas send, one PUSH per replica incarnation."""

    def __init__(self) -> None:
        self.context = zmq.Context()
        self.inbox = _socket(self.context, zmq.PULL)
        port = self.inbox.bind_to_random_port(f"tcp://{HOST}")
        self.inbox_address = f"tcp://{HOST}:{port}"
        self._poller = zmq.Poller()
        self._poller.register(self.inbox, zmq.POLLIN)

    def command_socket(self) -> tuple[zmq.Socket, str]:
        """A new PUSH socket for one replica incarnation, and the address it listens on."""
        sock = _socket(self.context, zmq.PUSH)
        port = sock.bind_to_random_port(f"tcp://{HOST}")
        return sock, f"tcp://{HOST}:{port}"

    @staticmethod
    def send(sock: zmq.Socket, message: tuple) -> None:
        sock.send(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL), copy=False)

    def receive(self, timeout_s: float) -> list[tuple]:
        """Every message waiting, after waiting up to `timeout_s` for the first one."""
        if not self._poller.poll(int(timeout_s * 1000)):
            return []
        messages = []
        while True:
            try:
                messages.append(pickle.loads(self.inbox.recv(zmq.NOBLOCK)))
            except zmq.Again:
                return messages

    def close(self) -> None:
        self.context.destroy(linger=0)


class ReplicaLink:
    """A replica's end: PULL its commands, PUSH its reports (each tagged with its index and incarnation)."""

    def __init__(self, commands_address: str, front_address: str, replica: int, incarnation: int):
        self.context = zmq.Context()
        self.commands = _socket(self.context, zmq.PULL)
        self.commands.connect(commands_address)
        self.reports = _socket(self.context, zmq.PUSH)
        self.reports.connect(front_address)
        self.tag = (replica, incarnation)

    def send(self, kind: str, *payload: Any) -> None:
        self.reports.send(pickle.dumps((kind, *self.tag, *payload), protocol=pickle.HIGHEST_PROTOCOL), copy=False)

    def receive(self, timeout_s: float) -> list[tuple]:
        """Every command waiting, after waiting up to `timeout_s` for the first one."""
        if not self.commands.poll(int(timeout_s * 1000)):
            return []
        commands = []
        while True:
            try:
                commands.append(pickle.loads(self.commands.recv(zmq.NOBLOCK)))
            except zmq.Again:
                return commands

    def close(self) -> None:
        """Gives the last reports (a failure) up to a second to leave, then closes."""
        self.reports.close(linger=1000)
        self.commands.close(linger=0)
        self.context.term()
