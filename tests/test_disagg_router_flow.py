"""The router's request flow against fake instances (httpx.MockTransport, no model): the bodies each instance
gets, a prefill instance that is down or fails sends the request to the next one exactly once, a 4xx goes back as
is, every instance down is a 503 naming each failure, a decode instance that refused the connection is skipped,
and the least loaded instance goes first."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from cpllm.router.config import RouterConfig
from cpllm.router.flow import Passed, RouteError, open_decode, prefill, prefill_body
from cpllm.router.instances import Pool

PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [0, 1], "remote_engine_id": "e",
          "remote_host": "127.0.0.1", "remote_port": 1, "remote_request_id": "r", "tp_size": 1}


def fake(behaviour: dict[str, str], seen: list):
    """A transport where each host does what `behaviour` says: ok, refuse (no connection), fail (500), bad (400)."""
    def handle(request: httpx.Request) -> httpx.Response:
        host = request.url.host
        seen.append((host, json.loads(request.content)))
        kind = behaviour[host]
        if kind == "refuse":
            raise httpx.ConnectError("connection refused", request=request)
        if kind == "fail":
            return httpx.Response(500, json={"error": {"message": "the engine failed"}})
        if kind == "bad":
            return httpx.Response(400, json={"error": {"message": "max_tokens too large"}})
        if kind == "no-params":
            return httpx.Response(200, json={"choices": []})
        return httpx.Response(200, json={"choices": [{"text": "x"}], "kv_transfer_params": PARAMS})
    return httpx.AsyncClient(transport=httpx.MockTransport(handle))


def run_prefill(behaviour: dict[str, str]) -> tuple[object, list, Pool]:
    seen: list = []
    pool = Pool("prefill", tuple(f"http://{h}" for h in behaviour))

    async def go():
        async with fake(behaviour, seen) as client:
            try:
                return await prefill(client, pool, "/v1/completions", {"prompt": "hi", "max_tokens": 9,
                                                                      "stream": True}, {})
            except (RouteError, Passed) as error:
                return error
    return asyncio.run(go()), seen, pool


def test_prefill_body_is_vllms_proxy_request():
    body = prefill_body({"messages": [], "max_tokens": 50, "max_completion_tokens": 50, "stream": True,
                         "stream_options": {"include_usage": True}, "min_tokens": 3, "temperature": 0})
    assert body == {"messages": [], "max_tokens": 1, "max_completion_tokens": 1, "stream": False, "temperature": 0,
                    "kv_transfer_params": {"do_remote_decode": True}}


@pytest.mark.parametrize("first", ["refuse", "fail", "no-params"])
def test_a_failed_prefill_instance_sends_the_request_to_the_next_once(first):
    got, seen, pool = run_prefill({"a": first, "b": "ok", "c": "ok"})
    assert got == PARAMS
    assert [host for host, _ in seen] == ["a", "b"]  # c never sees it: nothing is computed twice
    assert seen[1][1]["kv_transfer_params"] == {"do_remote_decode": True} and seen[1][1]["max_tokens"] == 1
    a = pool.instances[0]
    assert a.healthy == (first == "no-params") and all(i.in_flight == 0 for i in pool.instances)


def test_every_prefill_instance_failing_is_a_503_naming_each():
    got, seen, pool = run_prefill({"a": "refuse", "b": "fail"})
    assert isinstance(got, RouteError) and got.status == 503
    assert "http://a: ConnectError: connection refused" in got.message
    assert "http://b: 500 the engine failed" in got.message
    assert not pool.can_serve and len(seen) == 2


def test_a_client_error_goes_back_unchanged_and_is_not_retried():
    got, seen, pool = run_prefill({"a": "bad", "b": "ok"})
    assert isinstance(got, Passed) and got.status == 400 and b"max_tokens too large" in got.content
    assert len(seen) == 1 and pool.can_serve


def test_the_least_loaded_healthy_instance_goes_first():
    pool = Pool("prefill", ("http://a", "http://b", "http://c"))
    a, b, c = pool.instances
    a.in_flight, b.in_flight, c.in_flight = 2, 1, 0
    c.mark_down("gone")
    assert pool.order() == [b, a, c]
    b.in_flight = 2
    a.sent = 5
    assert pool.order() == [b, a, c]  # equal load: the one sent fewer requests


def test_decode_skips_an_instance_that_refused_the_connection():
    seen: list = []
    pool = Pool("decode", ("http://a", "http://b"))

    async def go():
        async with fake({"a": "refuse", "b": "ok"}, seen) as client:
            instance, response = await open_decode(client, pool, "/v1/completions", {"prompt": "hi"}, {}, PARAMS)
            await response.aclose()
            return instance
    assert asyncio.run(go()).url == "http://b"
    assert seen[-1][1] == {"prompt": "hi", "kv_transfer_params": PARAMS}
    assert not pool.instances[0].healthy


def test_router_config_refuses_bad_urls():
    with pytest.raises(ValueError, match="prefill_urls is empty"):
        RouterConfig(prefill_urls=(), decode_urls=("http://a",))
    with pytest.raises(ValueError, match="'localhost:8000' is not an http"):
        RouterConfig(prefill_urls=("localhost:8000",), decode_urls=("http://a",))
