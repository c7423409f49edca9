"""The FastAPI application: routes, API key, body size limit, errors in OpenAI's shape, HTTP metrics."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute, Match

from cpllm.server.admission import Admission
from cpllm.server.async_engine import AsyncEngine, EngineDeadError
from cpllm.server.cancellation import unless_disconnected
from cpllm.server.errors import APIError, bad_request, from_validation_error
from cpllm.server.extra_routes import add_batch_routes, add_extra_routes, model_card
from cpllm.server.formatting import TokenTexts
from cpllm.server.health import HealthReport
from cpllm.server.load_tracking import LoadCounter, ServerLoad
from cpllm.server.metrics import ServerMetrics
from cpllm.server.openapi import install_openapi
from cpllm.server.options import ServeOptions
from cpllm.server.protocol import ChatCompletionRequest, CompletionRequest
from cpllm.server.protocol_responses import ResponsesRequest
from cpllm.server.protocol_tokenize import DetokenizeRequest, TokenizeRequest
from cpllm.server.requests import EventStream, ServerContext
from cpllm.server.serving_chat import create_chat_completion
from cpllm.server.serving_completion import create_completion

logger = logging.getLogger(__name__)

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def build_app(engine: AsyncEngine, *, model_name: str, api_key: str | None = None,
              options: ServeOptions | None = None) -> FastAPI:
    """The app; its lifespan starts the engine thread and, on shutdown, stops it and the worker ranks."""
    options = options or ServeOptions()
    metrics = engine.metrics or ServerMetrics(model_name)
    engine.metrics = metrics
    max_body_bytes = options.body_limit(engine.max_model_len)
    admission = Admission(engine.running_slots, options.max_queued_requests, options.retry_after_s)
    ctx = ServerContext(engine=engine, model_name=model_name, texts=TokenTexts(engine.tokenizer), options=options,
                        admission=admission)
    logger.info("limits: request body %d bytes, n <= %d, %d sequences in flight (%d running + %d queued)",
                max_body_bytes, options.max_n, admission.limit, engine.running_slots, options.max_queued_requests)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        engine.start(asyncio.get_running_loop())
        yield
        logger.info("stopping the engine")
        await asyncio.to_thread(engine.shutdown)

    # root_path: FastAPI serves every route both under the prefix (/llm/v1/...) and without it, as vLLM does
    app = FastAPI(title="cpllm", lifespan=lifespan, docs_url=None, redoc_url=None, root_path=options.root_path)
    app.add_middleware(_HTTPMetrics, metrics=metrics, routes=app.router.routes)
    load = LoadCounter() if options.enable_server_load_tracking else None
    if load is not None:
        app.add_middleware(ServerLoad, counter=load)
    _add_error_handlers(app)

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")

    async def parse(request: Request, model: type[BaseModel]):
        authorize(request)
        body = await _read_body(request, max_body_bytes)
        try:
            parsed = model.model_validate_json(body)
        except ValidationError as exc:
            raise from_validation_error(exc) from exc
        if parsed.model is not None and parsed.model != model_name:
            raise APIError(404, f"the model {parsed.model!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")
        return parsed

    def respond(result):
        if isinstance(result, Response):  # the client left before the answer (unless_disconnected)
            return result
        if isinstance(result, dict):
            return JSONResponse(result)
        return _EventResponse(result)

    def probe(ok: Callable[[HealthReport], bool]) -> JSONResponse:
        report = engine.health()
        good = ok(report)
        return JSONResponse(report.as_json(good), status_code=200 if good else 503)

    @app.get("/health")
    async def health() -> Response:
        return probe(lambda r: r.healthy)

    @app.get("/health/ready")
    async def ready() -> Response:
        return probe(lambda r: r.ready)

    @app.get("/health/live")
    async def live() -> Response:
        return probe(lambda r: r.live)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        authorize(request)
        return JSONResponse({"object": "list", "data": [model_card(ctx)]})

    @app.post("/v1/completions")
    async def completions(request: Request):
        arrival = time.monotonic()
        req = await parse(request, CompletionRequest)
        return respond(await unless_disconnected(request, create_completion(ctx, req, arrival)))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        arrival = time.monotonic()
        req = await parse(request, ChatCompletionRequest)
        return respond(await unless_disconnected(request, create_chat_completion(ctx, req, arrival)))

    add_extra_routes(app, ctx, parse=parse, authorize=authorize, respond=respond, health=health)
    add_batch_routes(app, ctx, parse=parse, respond=respond, load=load)
    install_openapi(app, {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
                          "/v1/responses": ResponsesRequest, "/tokenize": TokenizeRequest,
                          "/detokenize": DetokenizeRequest})
    return app


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refusing (413) as soon as it is known to exceed `limit` bytes, whether announced or not."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body of {int(declared)} bytes exceeds the limit of {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    body = b"".join(chunks)
    if not body.strip():
        raise bad_request("the request body is empty; send a JSON object")
    return body


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_request: Request, exc: EngineDeadError):
        return APIError(503, str(exc)).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException):
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(Exception)
    async def unexpected(_request: Request, exc: Exception):
        logger.exception("unhandled error")
        return APIError(500, f"internal error: {exc!r}").response()


class _EventResponse(StreamingResponse):
    """Server-sent events whose request is closed even when the client leaves before the first event."""

    def __init__(self, events: EventStream):
        super().__init__(events, media_type="text/event-stream", headers=_SSE_HEADERS)
        self._events = events

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose(status=499)  # no-op when the stream ended by itself


UNMATCHED_ROUTE = "unmatched"
"""The `route` label of every path no route matches, so that scanning random paths adds no series."""


def route_label(routes: list[BaseRoute], scope) -> str:
    """The path template of the route that serves `scope` (`/v1/models/{model_id}`, not the id asked for); a
    route matching the path but not the method (a 405) counts under its template too."""
    partial = None
    for route in routes:
        match, _ = route.matches(scope)
        if match == Match.FULL:
            return getattr(route, "path", UNMATCHED_ROUTE)
        if match == Match.PARTIAL and partial is None:
            partial = getattr(route, "path", None)
    return partial or UNMATCHED_ROUTE


class _HTTPMetrics:
    """ASGI middleware counting responses by route and status (streams count when their headers go out)."""

    def __init__(self, app, metrics: ServerMetrics, routes: list[BaseRoute]):
        self.app = app
        self.metrics = metrics
        self.routes = routes
        """The app's route table (the list itself, so routes added after the middleware count too)."""

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        async def counting_send(message):
            if message["type"] == "http.response.start":
                route = route_label(self.routes, scope)
                self.metrics.http_requests.labels(route=route, status=str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)
