"""The router's balancing by each instance's own queue depth (docs/disaggregated.md, "Choosing an instance"): the
depth read from cpllm's own /metrics text and from labelled gauges, the order preferring the lower reported queue
over the router's own in-flight count, a burst between two polls spread by the requests sent since the report, a
/metrics failure leaving the instance healthy and balanced by its in-flight count, and the router's /health
showing each instance's reported queue and load. Fake instances: httpx.MockTransport, no model."""

from __future__ import annotations

import asyncio

import httpx
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, Gauge, generate_latest

from cpllm.router.app import build_router_app
from cpllm.router.config import RouterConfig
from cpllm.router.instances import Pool, check, check_all, parse_queue_depth
from cpllm.server.metrics import ServerMetrics


def served_metrics(running: int, waiting: int) -> str:
    """The /metrics text of a `cpllm serve` whose scheduler runs `running` and queues `waiting` sequences."""
    metrics = ServerMetrics("tiny")
    metrics.set_engine_state(running, waiting, 0.5, {0: 0.5})
    text = metrics.render()
    return text.decode() if isinstance(text, bytes) else text


def instances(metrics: dict[str, object], seen: list | None = None, during_metrics=None) -> httpx.AsyncClient:
    """Fake instances by host: /health answers 200 (or what `metrics` maps "<host>/health" to); /metrics answers
    the text `metrics` maps the host to, an int status, or raises it when it is an exception. `during_metrics`
    runs while a /metrics request is answered (a request the router sends meanwhile)."""
    def handle(request: httpx.Request) -> httpx.Response:
        host, path = request.url.host, request.url.path
        if seen is not None:
            seen.append((host, path))
        if path == "/health":
            return httpx.Response(metrics.get(f"{host}/health", 200), json={"status": "ok"})
        answer = metrics[host]
        if during_metrics is not None:
            during_metrics(host)
        if isinstance(answer, Exception):
            raise answer
        if isinstance(answer, int):
            return httpx.Response(answer, text="no metrics here")
        return httpx.Response(200, text=answer)
    return httpx.AsyncClient(transport=httpx.MockTransport(handle))


def poll(pool: Pool, metrics: dict[str, object], **fake) -> None:
    async def go():
        async with instances(metrics, **fake) as client:
            await check_all(client, [pool], 2.0)
    asyncio.run(go())


def test_the_queue_depth_of_cpllms_own_metrics_text():
    text = served_metrics(running=2, waiting=3)
    assert "cpllm_num_requests_running" in text  # cpllm's own names of the same figures are not counted again
    assert parse_queue_depth(text) == 5


def test_the_queue_depth_sums_every_label_set():
    registry = CollectorRegistry()
    names = ["model_name", "engine"]
    running = Gauge("vllm:num_requests_running", "running", names, registry=registry)
    waiting = Gauge("vllm:num_requests_waiting", "waiting", names, registry=registry)
    running.labels(model_name="m", engine="0").set(4)
    running.labels(model_name="m", engine="1").set(1)
    waiting.labels(model_name="m", engine="0").set(2)
    waiting.labels(model_name="m", engine="1").set(0)
    assert parse_queue_depth(generate_latest(registry).decode()) == 7


def test_no_queue_depth_without_both_gauges_or_from_other_text():
    registry = CollectorRegistry()
    Gauge("vllm:num_requests_running", "running", registry=registry).set(3)
    assert parse_queue_depth(generate_latest(registry).decode()) is None  # waiting is missing
    assert parse_queue_depth("<html>a proxy's page</html>") is None
    assert parse_queue_depth("") is None
    assert parse_queue_depth("vllm:num_requests_running 1\nvllm:num_requests_waiting 2\n") == 3  # untyped lines


def test_the_lower_reported_queue_goes_first_whatever_the_routers_own_count():
    pool = Pool("decode", ("http://a", "http://b"))
    a, b = pool.instances
    a.in_flight, b.in_flight = 0, 3  # by the router's count alone a goes first
    assert pool.order() == [a, b]
    poll(pool, {"a": served_metrics(6, 2), "b": served_metrics(3, 0)})  # other clients keep a busy
    assert (a.reported_queue, b.reported_queue) == (8, 3) and a.healthy and b.healthy
    assert (a.load, b.load) == (8, 3)
    assert pool.order() == [b, a]
    assert a.reported_at is not None and a.queue_problem is None


def test_a_burst_between_polls_spreads_and_a_report_resets_it():
    """Every pick sends a request (as flow.py does) that runs on: without the count of requests sent since the
    report, every one of them would go to the instance that reported the shorter queue."""
    pool = Pool("prefill", ("http://a", "http://b"))
    a, b = pool.instances
    poll(pool, {"a": served_metrics(0, 0), "b": served_metrics(2, 0)})
    picks = []
    for _ in range(6):
        first = pool.order()[0]
        first.sent += 1
        first.in_flight += 1
        picks.append(first.url[-1])
    assert picks == ["a", "a", "b", "a", "b", "a"]  # a catches up with b's 2, then they alternate
    assert (a.sent_since_report, b.sent_since_report) == (4, 2) and (a.load, b.load) == (4, 4)
    # the next report counts the requests still running itself; those sent before it are not added again
    poll(pool, {"a": served_metrics(1, 0), "b": served_metrics(4, 0)})
    assert (a.sent_since_report, b.sent_since_report) == (0, 0) and (a.load, b.load) == (1, 4)


def test_a_request_sent_while_metrics_answers_counts_in_the_burst():
    pool = Pool("decode", ("http://a",))
    a = pool.instances[0]
    a.sent = 3

    def send(_host):
        a.sent += 1  # the report may not show it: it stays in the burst until the next report
    poll(pool, {"a": served_metrics(2, 0)}, during_metrics=send)
    assert a.sent_since_report == 1 and a.load == 3


def test_a_failed_metrics_keeps_the_instance_healthy_and_falls_back_to_in_flight():
    pool = Pool("decode", ("http://a", "http://b", "http://c"))
    a, b, c = pool.instances
    poll(pool, {"a": served_metrics(5, 5), "b": served_metrics(5, 5), "c": served_metrics(5, 5)})
    assert a.reported_queue == b.reported_queue == c.reported_queue == 10
    a.in_flight, b.in_flight, c.in_flight = 2, 1, 3
    refused = httpx.ConnectError("connection refused")
    poll(pool, {"a": 404, "b": refused, "c": "# no gauges here\n"})
    assert all(i.healthy and i.problem is None for i in pool.instances)
    assert (a.reported_queue, b.reported_queue, c.reported_queue) == (None, None, None)
    assert a.reported_at is None
    assert (a.load, b.load, c.load) == (2, 1, 3) and pool.order() == [b, a, c]
    assert a.queue_problem == "/metrics answered 404"
    assert b.queue_problem == "/metrics: ConnectError: connection refused"
    assert c.queue_problem.startswith("/metrics gives no vllm:num_requests_running")


def test_an_instance_down_is_not_asked_for_metrics_and_drops_its_report():
    pool = Pool("prefill", ("http://a",))
    a = pool.instances[0]
    poll(pool, {"a": served_metrics(1, 1)})
    assert a.reported_queue == 2
    seen: list = []

    async def go():
        async with instances({"a/health": 503, "a": served_metrics(1, 1)}, seen) as client:
            await check(client, a, 2.0)
    asyncio.run(go())
    assert not a.healthy and a.reported_queue is None and seen == [("a", "/health")]


def test_the_routers_health_shows_each_instances_reported_queue_and_load():
    config = RouterConfig(prefill_urls=("http://p",), decode_urls=("http://d", "http://e"), health_interval_s=60)
    metrics = {"p": served_metrics(1, 2), "d": served_metrics(0, 4), "e": 500}

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200, json={"status": "ok"})
        answer = metrics[request.url.host]
        return httpx.Response(answer) if isinstance(answer, int) else httpx.Response(200, text=answer)
    app = build_router_app(config, transport=httpx.MockTransport(handle))
    with TestClient(app) as client:
        app.state.pools["decode"].instances[1].in_flight = 2
        body = client.get("/health").json()
        exposed = client.get("/metrics").text
    assert body["status"] == "ok"
    assert [(i["reported_queue"], i["load"]) for i in body["prefill"]] == [(3, 3)]
    assert [(i["reported_queue"], i["load"]) for i in body["decode"]] == [(4, 4), (None, 2)]
    assert body["decode"][1]["healthy"] and body["decode"][1]["queue_problem"] == "/metrics answered 500"
    assert 'cpllm_router_load{role="decode",url="http://d"} 4' in exposed
