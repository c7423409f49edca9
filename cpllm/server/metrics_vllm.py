"""The series vLLM's dashboards and alerts read, under vLLM's names (`vllm:` prefix, `model_name` label).

prometheus_client appends `_total` to counters, as it does for vLLM, so the
scraped names are vLLM's too (`vllm:prompt_tokens_total`, ...).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from cpllm.engine.engine import SchedulerTotals
from cpllm.engine.outputs import RequestOutput

ENGINE_GAUGE_MODE = "mostrecent"
"""How prometheus_client's multiprocess mode (--api-server-count > 1) merges a gauge: the engine's figures are
the same in every API server and only API server 0 sets them, so the latest value is the engine's."""
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 960.0)
_TOKEN_TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class VllmMetrics:
    """vLLM-named gauges, counters and histograms in the server's registry."""

    def __init__(self, registry: CollectorRegistry, model_name: str):
        self.model_name = model_name
        r, names = registry, ["model_name"]

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=r).labels(model_name=model_name)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=r, multiprocess_mode=ENGINE_GAUGE_MODE).labels(
                model_name=model_name)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets, registry=r).labels(model_name=model_name)

        self.running = gauge("vllm:num_requests_running", "Sequences the scheduler runs")
        self.waiting = gauge("vllm:num_requests_waiting", "Sequences waiting to be scheduled")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full)")
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.preemptions = counter("vllm:num_preemptions", "Running requests preempted to free KV blocks")
        self.spec_drafts = counter("vllm:spec_decode_num_drafts", "Verify chunks run (a request's drafts in a step)")
        self.spec_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Draft tokens scored")
        self.spec_accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens of finished requests")
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Arrival to first generated token",
                              _LATENCY_BUCKETS)
        self.inter_token = histogram("vllm:inter_token_latency_seconds",
                                     "Time between output tokens (each gap of a request at its mean)",
                                     _TOKEN_TIME_BUCKETS)
        self.tpot = histogram("vllm:time_per_output_token_seconds", "Mean time between output tokens, per request",
                              _TOKEN_TIME_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival to last token", _LATENCY_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds", "Arrival to first scheduled step",
                                    _LATENCY_BUCKETS)
        self.success = Counter("vllm:request_success", "Finished requests, by finish reason",
                               ["model_name", "finished_reason"], registry=r)
        self._totals_seen = SchedulerTotals()
        """Scheduler totals already exported: a Counter only goes up by increments."""

    def set_engine_state(self, running: int, waiting: int, kv_usage: float, totals: SchedulerTotals) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(kv_usage)
        seen = self._totals_seen
        self.preemptions.inc(max(0, totals.preemptions - seen.preemptions))
        self.spec_drafts.inc(max(0, totals.spec_drafts - seen.spec_drafts))
        self.spec_draft_tokens.inc(max(0, totals.spec_draft_tokens - seen.spec_draft_tokens))
        self.spec_accepted_tokens.inc(max(0, totals.spec_accepted_tokens - seen.spec_accepted_tokens))
        self.prefix_queries.inc(max(0, totals.prefix_query_tokens - seen.prefix_query_tokens))
        self.prefix_hits.inc(max(0, totals.prefix_hit_tokens - seen.prefix_hit_tokens))
        self._totals_seen = totals

    def observe_finished(self, output: RequestOutput, num_generated: int) -> None:
        m = output.metrics
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        self.generation_tokens.inc(num_generated)
        for completion in output.outputs:
            self.success.labels(model_name=self.model_name, finished_reason=completion.finish_reason or "abort").inc()
        if m.first_scheduled_time is not None:
            self.queue_time.observe(m.first_scheduled_time - m.arrival_time)
        if m.first_token_time is not None:
            self.ttft.observe(m.first_token_time - m.arrival_time)
        if m.finished_time is None:
            return
        self.e2e.observe(m.finished_time - m.arrival_time)
        longest = max((len(c.token_ids) for c in output.outputs), default=0)
        if longest > 1 and m.first_token_time is not None:
            mean_gap = (m.finished_time - m.first_token_time) / (longest - 1)
            self.tpot.observe(mean_gap)
            for _ in range(longest - 1):  # one observation per gap, so _count and _sum are vLLM's
                self.inter_token.observe(mean_gap)
