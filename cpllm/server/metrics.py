"""Prometheus metrics of one server, in their own registry (so that several apps can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from cpllm.engine.engine import SchedulerTotals
from cpllm.engine.outputs import RequestOutput
from cpllm.server.metrics_vllm import ENGINE_GAUGE_MODE, VllmMetrics

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_TOKEN_TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class ServerMetrics:
    """Counters, histograms and gauges the routes and the engine thread update."""

    def __init__(self, model_name: str, *, engine_figures: bool = True, multiprocess_dir: str | None = None):
        """`engine_figures` False: this process leaves the engine's gauges and counters to another API server (with
        --api-server-count N, API server 0 exports them); `multiprocess_dir`: render every API server's series
        from prometheus_client's multiprocess files there (PROMETHEUS_MULTIPROC_DIR, set before the import)."""
        self.engine_figures = engine_figures
        self.multiprocess_dir = multiprocess_dir
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        self._labels = labels
        r = self.registry
        self.http_requests = Counter("cpllm_http_requests", "HTTP requests by route and status",
                                     ["route", "status"], registry=r)
        self.finished = Counter("cpllm_request_success", "Generation requests finished, by finish reason",
                                ["model_name", "finished_reason"], registry=r)
        self.prompt_tokens = Counter("cpllm_prompt_tokens", "Prompt tokens of finished requests",
                                     ["model_name"], registry=r).labels(**labels)
        self.generation_tokens = Counter("cpllm_generation_tokens", "Generated tokens of finished requests",
                                         ["model_name"], registry=r).labels(**labels)
        self.ttft = Histogram("cpllm_time_to_first_token_seconds", "Arrival to first generated token",
                              ["model_name"], buckets=_LATENCY_BUCKETS, registry=r).labels(**labels)
        self.tpot = Histogram("cpllm_time_per_output_token_seconds", "Mean time between output tokens, per request",
                              ["model_name"], buckets=_TOKEN_TIME_BUCKETS, registry=r).labels(**labels)
        self.e2e = Histogram("cpllm_e2e_request_latency_seconds", "Arrival to last token",
                             ["model_name"], buckets=_LATENCY_BUCKETS, registry=r).labels(**labels)
        self.running = Gauge("cpllm_num_requests_running", "Sequences the scheduler is running",
                             ["model_name"], registry=r, multiprocess_mode=ENGINE_GAUGE_MODE).labels(**labels)
        self.waiting = Gauge("cpllm_num_requests_waiting", "Sequences waiting to be scheduled",
                             ["model_name"], registry=r, multiprocess_mode=ENGINE_GAUGE_MODE).labels(**labels)
        self.kv_usage = Gauge("cpllm_kv_cache_usage_perc", "Fraction of KV cache blocks in use, per rank",
                              ["model_name", "rank"], registry=r, multiprocess_mode=ENGINE_GAUGE_MODE)
        self.prefill_strategy = Counter(
            "cpllm_cp_prefill_strategy_steps", "Prompt steps of the driver's replica by the context-parallel prefill "
            "strategy they ran (with -pcp > 1; --cp-prefill-strategy auto picks per step)",
            ["model_name", "strategy"], registry=r)
        self.replica_healthy = Gauge("cpllm_replica_healthy", "1 while the DP replica serves (in rotation), else 0",
                                     ["model_name", "replica"], registry=r, multiprocess_mode=ENGINE_GAUGE_MODE)
        self.replica_restarts = Counter("cpllm_replica_restarts", "Restarts of each DP replica after a failure",
                                        ["model_name", "replica"], registry=r)
        self.requeued = Counter("cpllm_requests_requeued", "Requests moved to another replica before their first "
                                "token because theirs failed", ["model_name"], registry=r).labels(**labels)
        self.ended_by_failure = Counter("cpllm_requests_ended_by_replica_failure", "Requests that had sent tokens "
                                        "and were ended with an error because their replica failed",
                                        ["model_name"], registry=r).labels(**labels)
        self._seen = {"restarts": {}, "requeued": 0, "ended": 0}
        """Totals already exported (a Counter only goes up by increments)."""
        self._strategy_seen: dict[str, int] = {}
        """Totals already exported: the runner keeps running totals, a Counter only goes up by increments."""
        self.vllm = VllmMetrics(r, model_name)
        """The same figures (and the scheduler's) under vLLM's names, for vLLM's dashboards."""

    def set_engine_state(self, running: int, waiting: int, kv_usage: float, rank_usage: dict[int, float],
                         totals: SchedulerTotals | None = None) -> None:
        """Called by the engine thread after every step: sequences scheduled and queued (every replica), the KV
        usage overall and per global rank (a replica's ranks share block ids, so they read alike)."""
        if not self.engine_figures:
            return
        self.vllm.set_engine_state(running, waiting, kv_usage, totals or SchedulerTotals())
        self.running.set(running)
        self.waiting.set(waiting)
        for rank, usage in rank_usage.items():
            self.kv_usage.labels(model_name=self._labels["model_name"], rank=str(rank)).set(usage)

    def set_replicas(self, replicas, requeued: int = 0, ended: int = 0) -> None:
        """Each replica's health and restarts (ReplicaHealth values), and the front's failover totals."""
        if not self.engine_figures:
            return
        name = self._labels["model_name"]
        seen = self._seen
        for replica in replicas:
            label = str(replica.replica)
            self.replica_healthy.labels(model_name=name, replica=label).set(1 if replica.serving else 0)
            child = self.replica_restarts.labels(model_name=name, replica=label)
            before = seen["restarts"].get(label, 0)
            if replica.restarts > before:
                child.inc(replica.restarts - before)
            seen["restarts"][label] = replica.restarts
        if requeued > seen["requeued"]:
            self.requeued.inc(requeued - seen["requeued"])
            seen["requeued"] = requeued
        if ended > seen["ended"]:
            self.ended_by_failure.inc(ended - seen["ended"])
            seen["ended"] = ended

    def set_strategy_counts(self, counts: dict[str, int]) -> None:
        """The runner's prompt steps per strategy since start (every strategy appears, at 0 until it runs)."""
        if not self.engine_figures:
            return
        for strategy, total in counts.items():
            child = self.prefill_strategy.labels(model_name=self._labels["model_name"], strategy=strategy)
            seen = self._strategy_seen.get(strategy, 0)
            if total > seen:
                child.inc(total - seen)
            self._strategy_seen[strategy] = total

    def observe_finished(self, output: RequestOutput) -> None:
        """Token counts and latencies of a request that finished (or was aborted)."""
        m = output.metrics
        num_out = sum(len(c.token_ids) for c in output.outputs)
        self.vllm.observe_finished(output, num_out)
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        self.generation_tokens.inc(num_out)
        for completion in output.outputs:
            self.finished.labels(model_name=self._labels["model_name"],
                                 finished_reason=completion.finish_reason or "abort").inc()
        if m.first_token_time is not None:
            self.ttft.observe(m.first_token_time - m.arrival_time)
        if m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)
            longest = max((len(c.token_ids) for c in output.outputs), default=0)
            if longest > 1 and m.first_token_time is not None:
                self.tpot.observe((m.finished_time - m.first_token_time) / (longest - 1))

    def render(self) -> bytes:
        """The exposition text: this registry's, or every API server's summed (gauges: the latest value)."""
        if self.multiprocess_dir is None:
            return generate_latest(self.registry)
        merged = CollectorRegistry()
        MultiProcessCollector(merged, path=self.multiprocess_dir)
        return generate_latest(merged)
