"""Data parallelism with isolated replicas: each replica its own process tree, engine and step loop, behind a
front that routes requests over ZeroMQ (replica_link.py), takes a failed replica out of rotation at once,
re-queues the requests it had not started, ends the ones it had with an error, and restarts it in the background.

The front runs no model. It keeps every accepted request until it finishes, so that one not yet started (no token
sent to its client) can go to another replica unseen; one that streamed tokens is ended with an error naming the
failure, since repeating it would duplicate text the client already has. Outputs from a replica's dead
incarnation are dropped, so nothing is delivered twice. When every replica has failed and none may restart, `step`
raises: nothing can serve, and the server exits non-zero (cpllm/server/launcher.py).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Callable

from cpllm.config.engine import EngineConfig
from cpllm.engine.engine import LLMEngine, SchedulerTotals
from cpllm.engine.outputs import RequestOutput
from cpllm.engine.replica_handle import ReplicaHandle, restart_delay
from cpllm.engine.replica_link import FrontLink, ReplicaHealth
from cpllm.engine.sampling_params import SamplingParams
from cpllm.model.tokenization.tokenizer import Tokenizer
from cpllm.structured.manager import StructuredOutputManager

logger = logging.getLogger(__name__)

POLL_S = 0.02
"""Longest wait for a replica's report inside one `step` while requests are in flight."""
START_TIMEOUT_S = 600.0
"""Longest a replica may take from its process start to ready (loading the model)."""
HEARTBEAT_GRACE_S = 3.0
"""A serving replica silent for --distributed-timeout plus this long is hung (its own watchdog would have spoken)."""


class NoReplicaCanServe(RuntimeError):
    """Every replica has failed and none may be restarted."""


@dataclasses.dataclass(slots=True)
class _Accepted:
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    arrival_time: float | None


def _add(a: SchedulerTotals, b: SchedulerTotals | None) -> SchedulerTotals:
    if b is None:
        return a
    return SchedulerTotals(*(x + y for x, y in zip(dataclasses.astuple(a), dataclasses.astuple(b))))


class ReplicaFront:
    """The LLMEngine interface over DP replica processes (the server's and LLM's engine when DP > 1)."""

    idle_tick_s = 0.1
    """The server's engine thread calls `step` this often while idle, so failures and restarts are seen."""

    def __init__(self, config: EngineConfig, tokenizer: Tokenizer,
                 start: Callable[[int, str, str, int], tuple], *, max_restarts: int):
        self.config, self.tokenizer = config, tokenizer
        self.num_replicas = config.parallel.data_parallel_size
        self.replica_size = config.parallel.dims.replica_size
        self.dims = config.parallel.dims
        """The parallel dims: which global ranks each replica holds."""
        self.max_restarts = max_restarts
        self.link = FrontLink()
        self.replicas = [ReplicaHandle(i, self.link, lambda i, address, inc: start(i, address, self.link.inbox_address,
                                                                                   inc))
                         for i in range(self.num_replicas)]
        self._stall_s = config.parallel.distributed_timeout_s + HEARTBEAT_GRACE_S
        self.collect_failures = False
        """True (the server): failures of started requests wait in take_failures(); False (LLM): step raises."""
        self._requests: dict[str, _Accepted] = {}
        self._queue: collections.deque[str] = collections.deque()
        self._owner: dict[str, int] = {}
        self._started: set[str] = set()
        self._failures: list[tuple[str, str]] = []
        self._base_totals = [SchedulerTotals() for _ in self.replicas]
        """Totals of each replica's dead incarnations, so the exported counters never go down."""
        self._base_strategies = [collections.Counter() for _ in self.replicas]
        self.requeued = 0
        """Requests moved to another replica before their first token."""
        self.ended_by_failure = 0
        """Started requests ended with an error because their replica failed."""
        try:
            for replica in self.replicas:
                replica.start()
            self._wait_ready()
        except BaseException:
            self.shutdown()
            raise
        info = self.replicas[0].info
        self.max_model_len, self.kv_capacity_tokens = info.max_model_len, info.kv_capacity_tokens
        self._capacity_bounds_length = info.capacity_bounds_length
        """Read by LLMEngine.check_prompt (run on the front): whether the KV capacity bounds a request's length."""
        eos = tuple(config.model.eos_token_ids) or tuple(tokenizer.eos_token_ids)
        self.structured = StructuredOutputManager(tokenizer, config.model.vocab_size, eos)
        """The front's grammar cache: checks a request's grammar before it is accepted (each replica compiles its
        own copy when the request arrives)."""

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not all(r.state == "serving" for r in self.replicas):
            self._receive(0.1)
            for replica in self.replicas:
                problem = replica.exit_problem()
                if problem is not None:
                    raise RuntimeError(f"while starting: {problem}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the replicas were not ready within {START_TIMEOUT_S:g} s")

    # ---- requests ----------------------------------------------------------------------------------------

    def check_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        LLMEngine.check_prompt(self, prompt_token_ids, params)  # the replica's checks, on the limits it reported

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                    prompt: str | None = None, arrival_time: float | None = None) -> None:
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.check_prompt(prompt_token_ids, params)
        self._requests[request_id] = _Accepted(list(prompt_token_ids), params, prompt,
                                               arrival_time if arrival_time is not None else time.monotonic())
        self._queue.append(request_id)
        self._dispatch()

    def abort_request(self, request_id: str) -> None:
        if self._requests.pop(request_id, None) is None:
            return
        owner = self._owner.pop(request_id, None)
        self._started.discard(request_id)
        if owner is None:
            self._queue.remove(request_id)
        elif self.replicas[owner].socket is not None:
            self.replicas[owner].send(("abort", request_id))

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def prompt_progress(self) -> dict[str, int]:
        """Nothing: the replicas' prefill progress stays in their processes (not sent, to keep the link's
        traffic to outputs); a prompt counts as done when its first output arrives (engine/progress.py)."""
        return {}

    def take_failures(self) -> list[tuple[str, str]]:
        """(request id, message) of each started request ended by its replica's failure since the last call."""
        failures, self._failures = self._failures, []
        return failures

    def _forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        self._owner.pop(request_id, None)
        self._started.discard(request_id)

    def _dispatch(self) -> None:
        """Queued requests to the serving replica with the fewest requests of this front."""
        if not self._queue:
            return
        ready = [r for r in self.replicas if r.takes_requests()]
        if not ready:
            return
        load = collections.Counter(self._owner.values())
        while self._queue:
            request_id = self._queue.popleft()
            replica = min(ready, key=lambda r: load[r.index])
            item = self._requests[request_id]
            replica.send(("add", request_id, item.prompt_token_ids, item.params, item.prompt, item.arrival_time))
            self._owner[request_id] = replica.index
            load[replica.index] += 1

    # ---- the step ----------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Reports from the replicas (outputs of requests in flight), failures and restarts handled."""
        outputs = self._receive(POLL_S if self._owner else 0.0)
        self._check()
        self._dispatch()
        if self._failures and not self.collect_failures:
            request_id, message = self._failures[0]
            raise RuntimeError(f"request {request_id}: {message}")
        if all(r.state == "failed" and r.next_start is None for r in self.replicas):
            reasons = "; ".join(f"replica {r.index}: {r.reason}" for r in self.replicas)
            raise NoReplicaCanServe(f"no replica can serve and no restart is left (--max-replica-restarts "
                                    f"{self.max_restarts}): {reasons}")
        return outputs

    def _receive(self, timeout_s: float) -> list[RequestOutput]:
        delivered = []
        for kind, index, incarnation, *payload in self.link.receive(timeout_s):
            replica = self.replicas[index]
            if incarnation != replica.incarnation or replica.state == "failed":
                continue  # a dead incarnation's last words
            replica.last_seen = time.monotonic()
            if kind == "ready":
                self._ready(replica, payload[0])
            elif kind == "outputs":
                replica.report = payload[1]
                delivered += self._outputs(index, payload[0])
            elif kind == "failed":
                self._fail(replica, f"replica {index} failed: {payload[0]}")
            elif kind == "refused":
                request_id, message = payload
                if self._owner.get(request_id) == index:
                    self._forget(request_id)
                    self._failures.append((request_id, message))
        return delivered

    def _outputs(self, index: int, outputs: list[RequestOutput]) -> list[RequestOutput]:
        kept = []
        for output in outputs:
            if self._owner.get(output.request_id) != index:
                continue  # aborted, or moved to another replica
            kept.append(output)
            self._started.add(output.request_id)
            if output.finished:
                self._forget(output.request_id)
        return kept

    def _ready(self, replica: ReplicaHandle, info) -> None:
        replica.ready(info)
        if replica.failed_at is not None:
            logger.warning("replica %d is back and takes requests again, %.1f s after it failed (restart %d of %d)",
                           replica.index, time.monotonic() - replica.failed_at, replica.restarts, self.max_restarts)

    def _check(self) -> None:
        for replica in self.replicas:
            if replica.state in ("serving", "starting"):
                problem = replica.exit_problem() or replica.silent_problem(self._stall_s) \
                    or self._lasting_problem(replica)
                if problem is None and replica.state == "starting" \
                        and time.monotonic() - replica.started_at > START_TIMEOUT_S:
                    problem = f"replica {replica.index} was not ready {START_TIMEOUT_S:g} s after its start"
                if problem is not None:
                    self._fail(replica, problem)
            elif replica.next_start is not None and time.monotonic() >= replica.next_start:
                logger.warning("restarting replica %d (restart %d of %d)", replica.index, replica.restarts,
                               self.max_restarts)
                replica.start()

    def _lasting_problem(self, replica: ReplicaHandle) -> str | None:
        """A rank stopped (or dead) for longer than the deadline, even while the replica is idle and no step of its
        own would run into its watchdog: the replica cannot serve, so it is failed and restarted."""
        problems = replica.live_problems()
        if not problems:
            replica.unhealthy_since = None
            return None
        now = time.monotonic()
        replica.unhealthy_since = replica.unhealthy_since or now
        if now - replica.unhealthy_since <= self._stall_s:
            return None
        return f"{'; '.join(problems)} for {now - replica.unhealthy_since:.1f} s (deadline {self._stall_s:g} s)"

    def _fail(self, replica: ReplicaHandle, reason: str) -> None:
        """Out of rotation at once; its requests re-queued (not started) or ended (started); a restart scheduled."""
        logger.error("%s", reason)
        replica.state, replica.reason, replica.failed_at = "failed", reason, time.monotonic()
        replica.failures += 1
        self._base_totals[replica.index] = _add(self._base_totals[replica.index], replica.report.totals)
        self._base_strategies[replica.index].update(replica.report.strategy_counts)
        replica.kill()
        mine = [rid for rid, owner in self._owner.items() if owner == replica.index]
        ended = 0
        for request_id in reversed(mine):
            if request_id in self._started:
                self._forget(request_id)
                self._failures.append((request_id, f"{reason}; this request had already sent tokens, so it is "
                                                   "ended rather than run again"))
                ended += 1
            else:
                del self._owner[request_id]
                self._queue.appendleft(request_id)
        self.ended_by_failure += ended
        self.requeued += len(mine) - ended
        if mine:
            logger.warning("replica %d's %d request(s): %d re-queued to another replica, %d ended with an error",
                           replica.index, len(mine), len(mine) - ended, ended)
        replica.report = dataclasses.replace(replica.report, running=0, waiting=0, kv_usage=0.0)
        if replica.restarts < self.max_restarts:
            delay = restart_delay(replica.restarts)
            replica.restarts += 1
            replica.next_start = time.monotonic() + delay
            logger.warning("replica %d is out of rotation; restart %d of %d in %.1f s", replica.index,
                           replica.restarts, self.max_restarts, delay)
        else:
            logger.error("replica %d is out of rotation for good: its %d restart(s) are used (--max-replica-restarts)",
                         replica.index, self.max_restarts)

    # ---- what the server reads ---------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return sum(r.report.running for r in self.replicas)

    @property
    def num_waiting(self) -> int:
        """Waiting in the replicas' schedulers, plus accepted ones no replica has taken yet."""
        return sum(r.report.waiting for r in self.replicas) + len(self._queue)

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of all replicas' KV blocks in use (every replica has the same number)."""
        return sum(r.report.kv_usage for r in self.replicas) / self.num_replicas

    def rank_kv_usage(self) -> dict[int, float]:
        """Global rank -> fraction of its KV blocks in use (a replica's ranks share block ids)."""
        firsts = {r.index: self.dims.rank_of(r.index, 0, 0) for r in self.replicas}
        return {rank: r.report.kv_usage for r in self.replicas
                for rank in self.dims.members("replica", firsts[r.index])}

    @property
    def scheduler_totals(self) -> SchedulerTotals:
        total = SchedulerTotals()
        for replica, base in zip(self.replicas, self._base_totals):
            total = _add(_add(total, base), replica.report.totals if replica.state != "failed" else None)
        return total

    def strategy_counts(self) -> dict[str, int]:
        counts = collections.Counter()
        for replica, base in zip(self.replicas, self._base_strategies):
            counts.update(base)
            if replica.state != "failed":
                counts.update(replica.report.strategy_counts)
        return dict(counts)

    def replica_health(self) -> list[ReplicaHealth]:
        return [r.health() for r in self.replicas]

    def shutdown(self) -> None:
        for replica in self.replicas:
            replica.next_start = None
            replica.stop()
        deadline = time.monotonic() + self.config.parallel.distributed_timeout_s
        for replica in self.replicas:
            replica.join(max(0.0, deadline - time.monotonic()))
        self.link.close()
