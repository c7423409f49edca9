"""Per-request timing metrics in a response (--enable-per-request-metrics), as vLLM 0.33 reports them: a `metrics`
object beside `usage`, from the engine's timestamps of the request (RequestMetrics, time.monotonic() seconds)."""

from __future__ import annotations

from cpllm.engine.outputs import RequestOutput


def timing_metrics(output: RequestOutput, generated: int) -> dict[str, float]:
    """vLLM's fields, each left out when a timestamp it needs is missing (as vLLM drops its None fields):
    queue_time_ms (arrival -> first scheduled), time_to_first_token_ms (first scheduled -> first token),
    generation_time_ms (first token -> last token: decode only), mean_itl_ms (that over generated - 1 gaps),
    tokens_per_second (generated over first scheduled -> last token, so prefill counts)."""
    m = output.metrics
    scheduled, first, last = m.first_scheduled_time, m.first_token_time, m.finished_time
    out: dict[str, float] = {}
    if scheduled is not None and m.arrival_time:
        out["queue_time_ms"] = max(scheduled - m.arrival_time, 0.0) * 1000
    if scheduled is not None and first is not None:
        out["time_to_first_token_ms"] = (first - scheduled) * 1000
    if first is not None and last is not None:
        out["generation_time_ms"] = (last - first) * 1000
        if generated > 1:
            out["mean_itl_ms"] = (last - first) / (generated - 1) * 1000
    if scheduled is not None and last is not None and last > scheduled:
        out["tokens_per_second"] = generated / (last - scheduled)
    return out


def metrics_field(enabled: bool, n: int, output: RequestOutput | None) -> dict:
    """`{"metrics": ...}` for a response, or {} when the flag is off or the request has n > 1 (the timestamps are
    one sequence's and cannot stand for the request, so vLLM leaves them out too)."""
    if not enabled or n != 1 or output is None:
        return {}
    return {"metrics": timing_metrics(output, sum(len(c.token_ids) for c in output.outputs))}
