"""The instances behind the router: their load (the queue depth each reports on its /metrics, plus the router's
requests sent since; the router's own requests in flight where no report is there), their health (polled /health,
and marked down on a failed connection), and the order in which a request tries them."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger(__name__)

QUEUE_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")
"""The gauges of an instance's /metrics whose sum is its queue depth (cpllm/server/metrics_vllm.py; vLLM's names,
so a vLLM instance reports it too)."""


@dataclasses.dataclass(eq=False)
class Instance:
    """One `cpllm serve` process as the router sees it."""

    url: str
    role: str
    """"prefill" or "decode"."""
    in_flight: int = 0
    """This router's requests the instance is working on now (exact for them, blind to other clients')."""
    sent: int = 0
    """Requests sent to it since start (breaks ties between equally loaded instances, so they alternate)."""
    healthy: bool = True
    """Its last /health answered 200 and no request since failed to reach it."""
    problem: str | None = None
    """Why it is not healthy: the /health answer or the failure of the last request."""
    reported_queue: int | None = None
    """Requests running + waiting on the instance by its own /metrics at the last poll (every client's, not only
    this router's); None before the first report, while it is down, or when its /metrics failed or lacked them."""
    reported_at: float | None = None
    """When that report was read (time.monotonic()); None with no report."""
    sent_at_report: int = 0
    """`sent` when that report was asked for: the requests sent after it are not in it."""
    queue_problem: str | None = None
    """Why the last poll gave no report (its /metrics failed or lacked the gauges); None while reports come."""

    @property
    def sent_since_report(self) -> int:
        """The router's requests started on the instance since its report was asked for: a burst between two polls
        that the report cannot show yet. Counting from `sent` at the report (rather than keeping the in-flight
        ones) leaves out those that finished before it: they are in neither the report nor this count."""
        return self.sent - self.sent_at_report

    @property
    def load(self) -> int:
        """What orders the instances: the instance's reported queue depth plus the requests sent since the report
        (so a burst spreads before the next poll), or this router's own requests in flight when no report is
        there."""
        if self.reported_queue is None:
            return self.in_flight
        return self.reported_queue + self.sent_since_report

    def mark_down(self, problem: str) -> None:
        if self.healthy:
            logger.warning("router: %s instance %s is down: %s", self.role, self.url, problem)
        self.healthy, self.problem = False, problem
        self.reported_queue = self.reported_at = None  # a restarted instance's queue is not the old one's

    def mark_up(self) -> None:
        if not self.healthy:
            logger.info("router: %s instance %s serves again", self.role, self.url)
        self.healthy, self.problem = True, None

    def set_report(self, queue: int | None, sent_then: int, problem: str | None = None) -> None:
        """A poll's /metrics read: the queue depth (None, with the reason, when there was none) and `sent` when
        it was asked for."""
        if problem is not None and problem != self.queue_problem:  # once per cause, not every poll
            logger.warning("router: %s instance %s gives no queue depth (balanced by the router's own count): %s",
                           self.role, self.url, problem)
        self.reported_queue, self.sent_at_report, self.queue_problem = queue, sent_then, problem
        self.reported_at = time.monotonic() if queue is not None else None

    def as_json(self) -> dict:
        return {"url": self.url, "healthy": self.healthy, "in_flight": self.in_flight, "sent": self.sent,
                "reported_queue": self.reported_queue, "load": self.load, "problem": self.problem,
                "queue_problem": self.queue_problem}


class Pool:
    """The instances of one role."""

    def __init__(self, role: str, urls: tuple[str, ...]):
        self.role = role
        self.instances = [Instance(url, role) for url in urls]

    def order(self) -> list[Instance]:
        """Every instance, in the order a request tries them: healthy ones first, the least loaded first (ties to
        the one sent fewer requests); those marked down last (they may have come back since the last poll)."""
        return sorted(self.instances, key=lambda i: (not i.healthy, i.load, i.sent))

    @property
    def can_serve(self) -> bool:
        return any(i.healthy for i in self.instances)


def parse_queue_depth(text: str) -> int | None:
    """Requests running + waiting in a Prometheus exposition text, each gauge summed over its label sets (one per
    model_name, engine, ...); None unless both gauges are there or when the text is not Prometheus text."""
    total, seen = 0.0, set()
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:  # by the sample's name: an untyped line has no family of that name
                if sample.name in QUEUE_GAUGES:
                    total += sample.value
                    seen.add(sample.name)
    except ValueError:
        return None
    return round(total) if len(seen) == len(QUEUE_GAUGES) else None


async def read_queue(client: httpx.AsyncClient, instance: Instance, timeout_s: float) -> None:
    """The instance's queue depth from its /metrics. A failure drops the report only (the load falls back to the
    in-flight count): /health alone decides health, and /metrics may be off or behind a proxy."""
    # Requests sent while /metrics answers may be in both the report and the burst: counted twice until the next
    # poll, which errs toward spreading a burst rather than piling it on one instance.
    sent_then = instance.sent
    try:
        response = await client.get(f"{instance.url}/metrics", timeout=timeout_s)
    except httpx.HTTPError as error:
        instance.set_report(None, sent_then, f"/metrics: {type(error).__name__}: {error or 'no answer'}")
        return
    if response.status_code != 200:
        instance.set_report(None, sent_then, f"/metrics answered {response.status_code}")
        return
    queue = parse_queue_depth(response.text)
    missing = None if queue is not None else f"/metrics gives no {' + '.join(QUEUE_GAUGES)} (both are needed)"
    instance.set_report(queue, sent_then, missing)


async def check(client: httpx.AsyncClient, instance: Instance, timeout_s: float) -> None:
    """Ask the instance's /health and mark it up or down by the answer; read a healthy one's queue depth."""
    try:
        response = await client.get(f"{instance.url}/health", timeout=timeout_s)
    except httpx.HTTPError as error:
        instance.mark_down(f"/health: {type(error).__name__}: {error or 'no answer'}")
        return
    if response.status_code != 200:
        instance.mark_down(f"/health answered {response.status_code}: {response.text[:200]}")
        return
    instance.mark_up()
    await read_queue(client, instance, timeout_s)


async def check_all(client: httpx.AsyncClient, pools: list[Pool], timeout_s: float) -> None:
    await asyncio.gather(*(check(client, i, timeout_s) for pool in pools for i in pool.instances))


async def poll_forever(client: httpx.AsyncClient, pools: list[Pool], interval_s: float, timeout_s: float) -> None:
    """The background health and queue poll (cancelled when the router stops)."""
    while True:
        await check_all(client, pools, timeout_s)
        await asyncio.sleep(interval_s)
