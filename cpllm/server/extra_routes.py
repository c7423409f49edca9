"""The routes a vLLM user scripts against beside the generation ones: /tokenize, /detokenize, /version, /ping,
/v1/models/{model_id} and /v1/responses; and vLLM's /v1/chat/completions/batch, /invocations and /load."""

from __future__ import annotations

import importlib.metadata
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from cpllm.server.cancellation import unless_disconnected
from cpllm.server.errors import APIError
from cpllm.server.protocol_responses import ResponsesRequest
from cpllm.server.protocol_tokenize import DetokenizeRequest, TokenizeRequest
from cpllm.server.requests import ServerContext
from cpllm.server.load_tracking import LoadCounter
from cpllm.server.serving_batch import (BatchChatCompletionRequest, InvocationRequest, create_batch_chat_completion,
                                        create_invocation)
from cpllm.server.serving_responses import create_response
from cpllm.server.serving_tokenize import detokenize, tokenize

Parse = Callable[[Request, type[BaseModel]], Awaitable[Any]]


def model_card(ctx: ServerContext) -> dict[str, Any]:
    """The served model as /v1/models lists it."""
    return {"id": ctx.model_name, "object": "model", "created": 0, "owned_by": "cpllm",
            "max_model_len": ctx.engine.max_model_len}


def add_extra_routes(app: FastAPI, ctx: ServerContext, *, parse: Parse, authorize: Callable[[Request], None],
                     respond: Callable[[Any], Response], health: Callable[[], Awaitable[Response]]) -> None:
    """Registers the routes on `app`; `parse`, `authorize`, `respond` and `health` are build_app's."""
    version = importlib.metadata.version("cpllm")

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        return await health()

    @app.get("/version")
    async def server_version() -> JSONResponse:
        return JSONResponse({"version": version})

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(request: Request, model_id: str) -> JSONResponse:
        authorize(request)
        if model_id != ctx.model_name:
            raise APIError(404, f"the model {model_id!r} does not exist; this server serves {ctx.model_name!r}",
                           param="model", code="model_not_found")
        return JSONResponse(model_card(ctx))

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> JSONResponse:
        return JSONResponse(tokenize(ctx, await parse(request, TokenizeRequest)))

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> JSONResponse:
        return JSONResponse(detokenize(ctx, await parse(request, DetokenizeRequest)))

    @app.post("/v1/responses")
    async def responses(request: Request):
        arrival = time.monotonic()
        req = await parse(request, ResponsesRequest)
        return respond(await unless_disconnected(request, create_response(ctx, req, arrival)))


def add_batch_routes(app: FastAPI, ctx: ServerContext, *, parse: Parse, respond: Callable[[Any], Response],
                     load: LoadCounter | None) -> None:
    """/v1/chat/completions/batch, /invocations and /load (`load`: the in-flight count, None when not tracked)."""

    @app.post("/v1/chat/completions/batch")
    async def batch_chat(request: Request):
        arrival = time.monotonic()
        req = await parse(request, BatchChatCompletionRequest)
        return respond(await unless_disconnected(request, create_batch_chat_completion(ctx, req, arrival)))

    @app.post("/invocations")
    async def invocations(request: Request):
        arrival = time.monotonic()
        req = await parse(request, InvocationRequest)
        return respond(await unless_disconnected(request, create_invocation(ctx, req, arrival)))

    @app.get("/load")
    async def server_load() -> JSONResponse:
        if load is None:
            raise APIError(404, "server load is not tracked; start the server with --enable-server-load-tracking",
                           code="load_tracking_disabled")
        return JSONResponse({"server_load": load.in_flight})
