"""The router's HTTP app: /v1/completions and /v1/chat/completions through a prefill and a decode instance,
/v1/models from a decode instance, /health over every instance (with each one's reported queue and load),
/metrics of the router's own counts."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from cpllm.router.config import RouterConfig
from cpllm.router.flow import Passed, RouteError, close_decode, open_decode, prefill, relay
from cpllm.router.instances import Pool, check_all, poll_forever

FORWARDED_HEADERS = ("authorization", "x-request-id")
"""Client headers passed on to the instances (an API key, the request id)."""


def build_router_app(config: RouterConfig, transport: httpx.AsyncBaseTransport | None = None) -> FastAPI:
    """`transport`: where the instances' requests go instead of the network (tests' fake instances)."""
    pools = {"prefill": Pool("prefill", config.prefill_urls), "decode": Pool("decode", config.decode_urls)}
    state: dict = {}

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        timeout = httpx.Timeout(config.request_timeout_s, connect=config.connect_timeout_s)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=timeout, limits=limits, transport=transport) as client:
            state["client"] = client
            poller = asyncio.create_task(poll_forever(client, list(pools.values()), config.health_interval_s,
                                                      config.health_timeout_s))
            try:
                yield
            finally:
                poller.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await poller

    app = FastAPI(title="cpllm router", lifespan=lifespan)
    app.state.pools = pools

    async def route(request: Request, path: str) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return JSONResponse(RouteError(400, "the body is not JSON").body(), status_code=400)
        if not isinstance(body, dict):
            return JSONResponse(RouteError(400, "the body must be a JSON object").body(), status_code=400)
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        client = state["client"]
        try:
            params = await prefill(client, pools["prefill"], path, body, headers)
            instance, response = await open_decode(client, pools["decode"], path, body, headers, params)
        except Passed as answer:
            return Response(answer.content, status_code=answer.status, media_type=answer.content_type or None)
        except RouteError as error:
            return JSONResponse(error.body(), status_code=error.status)
        if body.get("stream"):
            return StreamingResponse(relay(instance, response), media_type="text/event-stream")
        try:
            content = await response.aread()
        except httpx.HTTPError as error:
            instance.mark_down(str(error))
            failed = RouteError(502, f"decode instance {instance.url} failed: {type(error).__name__}: {error}")
            return JSONResponse(failed.body(), status_code=502)
        finally:
            await close_decode(instance, response)
        return Response(content, status_code=200, media_type=response.headers.get("content-type"))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await route(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await route(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        failures = []
        for instance in pools["decode"].order():
            try:
                response = await state["client"].get(f"{instance.url}/v1/models", headers=headers)
            except httpx.HTTPError as error:
                failures.append(f"{instance.url}: {type(error).__name__}: {error}")
                continue
            return Response(response.content, status_code=response.status_code,
                            media_type=response.headers.get("content-type"))
        error = RouteError(503, "no decode instance answered /v1/models: " + "; ".join(failures))
        return JSONResponse(error.body(), status_code=503)

    @app.get("/health")
    async def health() -> JSONResponse:
        """Every instance asked now; 503 while no prefill or no decode instance can serve."""
        await check_all(state["client"], list(pools.values()), config.health_timeout_s)
        body: dict = {role: [i.as_json() for i in pool.instances] for role, pool in pools.items()}
        missing = [role for role, pool in pools.items() if not pool.can_serve]
        if not missing:
            return JSONResponse({"status": "ok", **body})
        error = RouteError(503, " and ".join(f"no {role} instance can serve" for role in missing))
        return JSONResponse({"status": "unhealthy", **body, **error.body()}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        lines = ["# TYPE cpllm_router_in_flight gauge", "# TYPE cpllm_router_healthy gauge",
                 "# TYPE cpllm_router_load gauge", "# TYPE cpllm_router_requests_sent counter"]
        for role, pool in pools.items():
            for i in pool.instances:
                labels = f'{{role="{role}",url="{i.url}"}}'
                lines += [f"cpllm_router_in_flight{labels} {i.in_flight}",
                          f"cpllm_router_healthy{labels} {int(i.healthy)}",
                          f"cpllm_router_load{labels} {i.load}",
                          f"cpllm_router_requests_sent_total{labels} {i.sent}"]
        return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    return app
