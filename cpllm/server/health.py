"""What /health, /health/ready and /health/live answer: each replica's state, from its ranks and its step deadline.

- `/health` (vLLM's probe, also `/ping`): 200 only while every replica serves; 503 while any replica has a rank
  that is dead or stopped, a step past its deadline, is restarting, or the engine has stopped. The body names each
  replica and what is wrong with it.
- `/health/ready` (readiness): 200 while at least one replica takes requests, so a load balancer keeps sending
  while another replica heals; 503 when none does.
- `/health/live` (liveness): 200 while the server can still serve, now or after a restart in progress; 503 once
  nothing can (the process then exits non-zero within seconds, so a supervisor restarts it).
"""

from __future__ import annotations

import dataclasses

from cpllm.engine.replica_link import ReplicaHealth


@dataclasses.dataclass(frozen=True, slots=True)
class HealthReport:
    """The whole engine: its replicas, and why it stopped if it did."""

    replicas: tuple[ReplicaHealth, ...]
    error: str | None = None
    """Why the engine stopped serving for good, or None."""

    @property
    def healthy(self) -> bool:
        return self.error is None and all(r.serving for r in self.replicas)

    @property
    def ready(self) -> bool:
        return self.error is None and any(r.serving for r in self.replicas)

    @property
    def live(self) -> bool:
        return self.error is None and any(r.recoverable for r in self.replicas)

    def message(self) -> str:
        if self.error is not None:
            return f"the engine is not running (error: {self.error})"
        bad = [f"replica {r.replica} {r.state}" + (f": {'; '.join(r.problems)}" if r.problems else "")
               for r in self.replicas if not r.serving]
        return "; ".join(bad) if bad else "every replica serves"

    def as_json(self, ok: bool) -> dict:
        body: dict = {"status": "ok" if ok else "unhealthy", "replicas": [r.as_json() for r in self.replicas]}
        if not ok:
            body["error"] = {"message": self.message(), "type": "service_unavailable", "param": None, "code": None}
        return body
