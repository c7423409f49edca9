"""An API-server process's engine: the LLMEngine interface over the engine hub's ZeroMQ link (engine_hub.py).

AsyncEngine drives it exactly as it drives a local engine or a DP front: `add_request` checks the prompt here (on
the limits the engine process handed over) and sends it, `step` collects the hub's outputs for this process's
requests, and the figures AsyncEngine publishes come from the hub's latest EngineReport. When the engine process
fails or goes away, `step` raises, and the API server exits (cpllm/server/api_server.py).
"""

from __future__ import annotations

import dataclasses
import os
import time

from cpllm.config.engine import EngineConfig
from cpllm.engine.engine import LLMEngine
from cpllm.engine.outputs import RequestOutput
from cpllm.engine.replica_link import ReplicaLink
from cpllm.engine.sampling_params import SamplingParams
from cpllm.model.tokenization.tokenizer import Tokenizer
from cpllm.server.engine_hub import EngineReport, HubAddresses
from cpllm.structured.manager import StructuredOutputManager

POLL_S = 0.02
"""Longest wait for the hub's outputs inside one `step` while requests are in flight."""
SILENCE_GRACE_S = 3.0
"""The hub is gone when it sent nothing for --distributed-timeout plus this long (it heartbeats while idle)."""


@dataclasses.dataclass(kw_only=True, frozen=True, slots=True)
class EngineLimits:
    """What the engine process measured at start and every API server checks requests against."""

    max_model_len: int
    """Longest prompt plus output."""
    kv_capacity_tokens: int
    """Tokens one replica's KV cache holds."""
    capacity_bounds_length: bool
    """Whether the KV capacity bounds a request's length (False when sliding-window layers keep fewer)."""
    eos_token_ids: tuple[int, ...]
    """The model's end-of-sequence tokens."""


class EngineGoneError(RuntimeError):
    """The engine process failed or went away."""


class EngineClient:
    """One API-server process's view of the shared engine."""

    idle_tick_s = 0.1
    """AsyncEngine steps this client this often while idle, so heartbeats (and a dead engine) are seen."""

    def __init__(self, index: int, config: EngineConfig, tokenizer: Tokenizer, limits: EngineLimits,
                 addresses: HubAddresses):
        self.index = index
        self.config, self.tokenizer = config, tokenizer
        self.max_model_len, self.kv_capacity_tokens = limits.max_model_len, limits.kv_capacity_tokens
        self._capacity_bounds_length = limits.capacity_bounds_length
        """Read by LLMEngine.check_prompt (run here)."""
        self.eos_token_ids = limits.eos_token_ids
        self.structured = StructuredOutputManager(tokenizer, config.model.vocab_size, limits.eos_token_ids)
        """This process's grammar cache: a request's grammar is checked before it is sent."""
        self.collect_failures = False
        self.report = EngineReport()
        """The hub's latest figures."""
        self._requests: set[str] = set()
        self._failures: list[tuple[str, str]] = []
        self._engine_pid = os.getppid()
        self._silence_limit_s = config.parallel.distributed_timeout_s + SILENCE_GRACE_S
        self._last_heard = time.monotonic()
        self.link = ReplicaLink(addresses.clients[index], addresses.inbox, index, 0)
        self.link.send("hello")

    # ---- requests ----------------------------------------------------------------------------------------

    def check_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        LLMEngine.check_prompt(self, prompt_token_ids, params)  # the engine's checks, on the limits it reported

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                    prompt: str | None = None, arrival_time: float | None = None) -> None:
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.check_prompt(prompt_token_ids, params)
        arrival = arrival_time if arrival_time is not None else time.monotonic()  # one clock for every process
        self.link.send("add", request_id, list(prompt_token_ids), params, prompt, arrival)
        self._requests.add(request_id)

    def abort_request(self, request_id: str) -> None:
        if request_id in self._requests:
            self._requests.discard(request_id)
            self.link.send("abort", request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def take_failures(self) -> list[tuple[str, str]]:
        failures, self._failures = self._failures, []
        return failures

    def step(self) -> list[RequestOutput]:
        """The outputs the hub sent for this process's requests; raises EngineGoneError once the engine is gone."""
        delivered = []
        for kind, *payload in self.link.receive(POLL_S if self._requests else 0.0):
            self._last_heard = time.monotonic()
            if kind == "outputs":
                outputs, self.report = payload
                delivered += self._keep(outputs)
            elif kind == "failed":
                request_id, message = payload
                if request_id in self._requests:
                    self._requests.discard(request_id)
                    self._failures.append((request_id, message))
            elif kind == "dead":
                raise EngineGoneError(payload[0])
        self._check_engine()
        if self._failures and not self.collect_failures:
            request_id, message = self._failures[0]
            raise RuntimeError(f"request {request_id}: {message}")
        return delivered

    def _keep(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        kept = []
        for output in outputs:
            if output.request_id not in self._requests:
                continue  # aborted here since
            kept.append(output)
            if output.finished:
                self._requests.discard(output.request_id)
        return kept

    def _check_engine(self) -> None:
        if os.getppid() != self._engine_pid:
            raise EngineGoneError(f"the engine process (pid {self._engine_pid}) is gone")
        quiet = time.monotonic() - self._last_heard
        if quiet > self._silence_limit_s:
            raise EngineGoneError(f"the engine process (pid {self._engine_pid}) sent nothing for {quiet:.1f} s "
                                  f"(deadline {self._silence_limit_s:g} s: --distributed-timeout plus a grace)")

    # ---- what the server reads ---------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return self.report.running

    @property
    def num_waiting(self) -> int:
        return self.report.waiting

    @property
    def kv_cache_usage(self) -> float:
        return self.report.kv_usage

    def rank_kv_usage(self) -> dict[int, float]:
        return dict(self.report.rank_kv_usage)

    @property
    def scheduler_totals(self):
        return self.report.totals

    def strategy_counts(self) -> dict[str, int]:
        return dict(self.report.strategy_counts)

    def replica_health(self) -> list:
        return list(self.report.replicas)

    @property
    def requeued(self) -> int:
        return self.report.requeued

    @property
    def ended_by_failure(self) -> int:
        return self.report.ended_by_failure

    def shutdown(self) -> None:
        """Tells the hub this process is done (it aborts what is left of this process's requests)."""
        for request_id in list(self._requests):
            self.abort_request(request_id)
        self.link.send("bye")
        self.link.close()
