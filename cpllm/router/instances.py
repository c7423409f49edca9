"""The instances behind the router: their load (the router's own requests in flight on each), their health (polled
/health, and marked down on a failed connection), and the order in which a request tries them."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import httpx

logger = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class Instance:
    """One `cpllm serve` process as the router sees it."""

    url: str
    role: str
    """"prefill" or "decode"."""
    in_flight: int = 0
    """This router's requests the instance is working on now (its queue depth as far as the router knows)."""
    sent: int = 0
    """Requests sent to it since start (breaks ties between equally loaded instances, so they alternate)."""
    healthy: bool = True
    """Its last /health answered 200 and no request since failed to reach it."""
    problem: str | None = None
    """Why it is not healthy: the /health answer or the failure of the last request."""

    def mark_down(self, problem: str) -> None:
        if self.healthy:
            logger.warning("router: %s instance %s is down: %s", self.role, self.url, problem)
        self.healthy, self.problem = False, problem

    def mark_up(self) -> None:
        if not self.healthy:
            logger.info("router: %s instance %s serves again", self.role, self.url)
        self.healthy, self.problem = True, None

    def as_json(self) -> dict:
        return {"url": self.url, "healthy": self.healthy, "in_flight": self.in_flight, "sent": self.sent,
                "problem": self.problem}


class Pool:
    """The instances of one role."""

    def __init__(self, role: str, urls: tuple[str, ...]):
        self.role = role
        self.instances = [Instance(url, role) for url in urls]

    def order(self) -> list[Instance]:
        """Every instance, in the order a request tries them: healthy ones first, the least loaded first; those
        marked down last (they may have come back since the last poll)."""
        return sorted(self.instances, key=lambda i: (not i.healthy, i.in_flight, i.sent))

    @property
    def can_serve(self) -> bool:
        return any(i.healthy for i in self.instances)


async def check(client: httpx.AsyncClient, instance: Instance, timeout_s: float) -> None:
    """Ask the instance's /health and mark it up or down by the answer."""
    try:
        response = await client.get(f"{instance.url}/health", timeout=timeout_s)
    except httpx.HTTPError as error:
        instance.mark_down(f"/health: {type(error).__name__}: {error or 'no answer'}")
        return
    if response.status_code == 200:
        instance.mark_up()
    else:
        instance.mark_down(f"/health answered {response.status_code}: {response.text[:200]}")


async def check_all(client: httpx.AsyncClient, pools: list[Pool], timeout_s: float) -> None:
    await asyncio.gather(*(check(client, i, timeout_s) for pool in pools for i in pool.instances))


async def poll_forever(client: httpx.AsyncClient, pools: list[Pool], interval_s: float, timeout_s: float) -> None:
    """The background health poll (cancelled when the router stops)."""
    while True:
        await check_all(client, pools, timeout_s)
        await asyncio.sleep(interval_s)
