"""uvicorn with cpllm's ends (drain on SIGTERM, then end what still runs; a non-zero status when the engine can no
longer serve), for the one-process server (launcher.py) and each API-server process (api_server.py) alike. Apart
from launcher.py so that an API-server process does not import the engine's model code."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time

import uvicorn

from cpllm.server.async_engine import AsyncEngine

logger = logging.getLogger(__name__)

ENGINE_FAILED_EXIT = 3
"""Exit status once no replica can serve any more (a rank died and no restart is left), so that a supervisor
(systemd's Restart=on-failure, a container restart policy, torchrun's --max-restarts) starts the server again."""


class DrainingServer(uvicorn.Server):
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


def exit_now(code: int) -> None:
    """End the process without the interpreter's teardown: the ranks are reaped and nothing shared is left, and
    torch's C-level finalizers take about two seconds here, which would break the --shutdown-timeout promise."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)
