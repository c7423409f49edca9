"""`cpllm serve`: build the engine (and its worker ranks), then serve HTTP with uvicorn until SIGTERM / Ctrl-C."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time

import uvicorn

from cpllm.engine.llm import LLM
from cpllm.engine_args import engine_kwargs
from cpllm.server.app import build_app
from cpllm.server.async_engine import AsyncEngine
from cpllm.server.metrics import ServerMetrics
from cpllm.server.options import serve_options

logger = logging.getLogger(__name__)

ENGINE_FAILED_EXIT = 3
"""Exit status once no replica can serve any more (a rank died and no restart is left), so that a supervisor
(systemd's Restart=on-failure, a container restart policy, torchrun's --max-restarts) starts the server again."""


class _Server(uvicorn.Server):
    """uvicorn with cpllm's ends: SIGTERM drains for --shutdown-timeout, then ends what still runs with an error
    (a stream gets an error event and [DONE]) and exits 0; an engine that can no longer serve exits non-zero.

    uvicorn re-raises a caught SIGTERM after its graceful shutdown, which would end the process with status -15;
    a SIGTERM is the normal way to stop a server, so here it ends with status 0."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, shutdown_timeout_s: float):
        super().__init__(config)
        self.engine = engine
        self.shutdown_timeout_s = shutdown_timeout_s
        self.exit_code = 0
        self._exit_asked = time.monotonic()

    def handle_exit(self, sig: int, frame) -> None:
        if not self.should_exit:
            self._exit_asked = time.monotonic()
        if sig == signal.SIGTERM:
            logger.info("SIGTERM: no new connections; requests in flight get %g s to finish (--shutdown-timeout)",
                        self.shutdown_timeout_s)
            self.should_exit = True
            return
        super().handle_exit(sig, frame)

    def engine_failed(self, error: BaseException) -> None:
        """Called on the engine thread when its step loop fails; uvicorn's main loop sees the flag within 0.1 s."""
        self.exit_code = ENGINE_FAILED_EXIT
        logger.error("no replica can serve any more (%s); exiting with status %d", error, ENGINE_FAILED_EXIT)
        self._exit_asked = time.monotonic()
        self.should_exit = True

    async def shutdown(self, sockets=None) -> None:
        left = max(0.0, self.shutdown_timeout_s - (time.monotonic() - self._exit_asked))
        message = (f"the server is shutting down: this request was still running {self.shutdown_timeout_s:g} s "
                   "after SIGTERM (--shutdown-timeout)")
        timer = asyncio.get_running_loop().call_later(left, self.engine.end_all, message)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


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
    """`cpllm serve`: serves until SIGTERM or until no replica can serve, then ends the process (see _exit_now)."""
    try:
        options = serve_options(args)  # a bad flag fails here, before the model loads
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    llm = LLM(args.model_path or args.model, **engine_kwargs(args))  # other ranks never return from here
    name = served_model_name(args, llm.engine.config.model_path)
    engine = AsyncEngine(llm.engine, ServerMetrics(name))
    api_key = args.api_key or os.environ.get("VLLM_API_KEY") or None  # vLLM's environment variable too
    app = build_app(engine, model_name=name, api_key=api_key, options=options)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("listening on %s: reachable from other machines%s", args.host,
                       "" if api_key else " without an API key")
    logger.info("serving %r (max_model_len=%d) on http://%s:%d/v1", name, llm.engine.max_model_len,
                args.host, args.port)
    # uvicorn's own deadline is the backstop: by then end_all has ended every request
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                            access_log=False, timeout_graceful_shutdown=options.shutdown_timeout_s + 1.0)
    server = _Server(config, engine, options.shutdown_timeout_s)
    engine.on_failure = server.engine_failed
    try:
        server.run()
    finally:
        engine.shutdown()  # no-op when the lifespan already stopped it
    code = server.exit_code if server.started else 1
    logger.info("exiting with status %d", code)
    _exit_now(code)


def _exit_now(code: int) -> None:
    """End the process without the interpreter's teardown: the ranks are reaped and nothing shared is left, and
    torch's C-level finalizers take about two seconds here, which would break the --shutdown-timeout promise."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)
