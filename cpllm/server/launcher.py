"""`cpllm serve`: build the engine (and its worker ranks), then serve HTTP with uvicorn until SIGTERM / Ctrl-C."""

from __future__ import annotations

import argparse
import logging
import os
import signal

import uvicorn

from cpllm.engine.llm import LLM
from cpllm.engine_args import engine_kwargs
from cpllm.server.app import build_app
from cpllm.server.async_engine import AsyncEngine
from cpllm.server.metrics import ServerMetrics
from cpllm.server.options import serve_options

logger = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 30.0
"""After SIGTERM, requests in flight get this long to finish; the rest are cancelled (and aborted)."""


class _Server(uvicorn.Server):
    """uvicorn re-raises a caught SIGTERM after its graceful shutdown, which would end the process with
    status -15; a SIGTERM is the normal way to stop a server, so here it ends with status 0."""

    def handle_exit(self, sig: int, frame) -> None:
        if sig == signal.SIGTERM:
            logger.info("SIGTERM: no new connections; finishing the requests in flight")
            self.should_exit = True
            return
        super().handle_exit(sig, frame)


def served_model_name(args: argparse.Namespace, model_path: str) -> str:
    """--served-model-name, else the model argument as given, else the default model's file name."""
    if args.served_model_name:
        return args.served_model_name
    given = args.model_path or args.model
    if given:
        return given
    name = os.path.basename(model_path)
    return name.removesuffix(".gguf")


def run_server(args: argparse.Namespace) -> int:
    try:
        options = serve_options(args)  # a bad flag fails here, before the model loads
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    llm = LLM(args.model_path or args.model, **engine_kwargs(args))  # other ranks never return from here
    name = served_model_name(args, llm.engine.config.model_path)
    engine = AsyncEngine(llm.engine, ServerMetrics(name))
    app = build_app(engine, model_name=name, api_key=args.api_key, options=options)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("listening on %s: reachable from other machines%s", args.host,
                       "" if args.api_key else " without an API key")
    logger.info("serving %r (max_model_len=%d) on http://%s:%d/v1", name, llm.engine.max_model_len,
                args.host, args.port)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                            access_log=False, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    server = _Server(config)
    try:
        server.run()
    finally:
        engine.shutdown()  # no-op when the lifespan already stopped it
    return 0 if server.started else 1
