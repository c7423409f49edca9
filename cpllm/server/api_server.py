"""One API-server process of `cpllm serve --api-server-count N`: the whole HTTP front (the same app as a
single-process server) over an EngineClient, on its own SO_REUSEPORT socket of the shared port.

Started by the engine process (cpllm/server/api_servers.py) as a fresh interpreter (rank_entry), so it exits at
once if the engine process dies, even by SIGKILL. SIGTERM and SIGINT both drain: no new connections, requests in
flight get --shutdown-timeout to finish; the engine process sends the SIGTERM when it is asked to stop.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket

import uvicorn

from cpllm.config.engine import EngineConfig
from cpllm.model.tokenization.tokenizer import load_tokenizer
from cpllm.server.app import build_app
from cpllm.server.async_engine import AsyncEngine
from cpllm.server.engine_client import EngineClient, EngineLimits
from cpllm.server.engine_hub import HubAddresses
from cpllm.server.http_server import DrainingServer, exit_now
from cpllm.server.metrics import ServerMetrics
from cpllm.server.options import ServeOptions

logger = logging.getLogger(__name__)


@dataclasses.dataclass(kw_only=True, frozen=True, slots=True)
class ApiServerSpec:
    """What every API-server process is started with (pickled to it)."""

    count: int
    """API-server processes in all (--api-server-count)."""
    config: EngineConfig
    """The engine's config (its tokenizer path, vocabulary, limits and parallel layout)."""
    limits: EngineLimits
    """The limits the engine measured at start."""
    addresses: HubAddresses
    """The engine hub's ZeroMQ addresses."""
    model_name: str
    """The served model name."""
    api_key: str | None
    """Bearer key every route asks for, or None."""
    options: ServeOptions
    """The server's options (the same in every process)."""
    host: str
    """Where to listen (each process binds its own socket with SO_REUSEPORT)."""
    port: int
    """The shared port (the engine process holds it bound, so it cannot be taken while the servers start)."""
    log_level: str
    """--log-level's name, for this process's logging and uvicorn's."""
    metrics_dir: str
    """prometheus_client's multiprocess directory (PROMETHEUS_MULTIPROC_DIR): /metrics sums every process's."""


def reuseport_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) with SO_REUSEPORT, not yet listening: the kernel spreads new connections
    over the listening sockets of the port (the same user's only), one accept queue per process."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


class _ApiServer(DrainingServer):
    """The single-process server's drain on SIGTERM, for SIGINT too: a terminal's Ctrl-C reaches every process
    of the group, and each API server must finish its own requests while the engine process keeps stepping."""

    index: int = 0
    """This API server's index (for its log lines)."""

    def handle_exit(self, sig: int, frame) -> None:
        super().handle_exit(signal.SIGTERM, frame)

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            logger.info("api server %d (pid %d) accepts connections", self.index, os.getpid())


def api_server_main(index: int, spec: ApiServerSpec) -> None:
    """Entry point of API server `index` (run by rank_entry); ends the process when its server stops."""
    logging.basicConfig(level=getattr(logging, spec.log_level),
                        format=f"%(levelname)s api server {index}: %(name)s: %(message)s")
    client = EngineClient(index, spec.config, load_tokenizer(spec.config.model_path), spec.limits, spec.addresses)
    metrics = ServerMetrics(spec.model_name, engine_figures=index == 0, multiprocess_dir=spec.metrics_dir)
    engine = AsyncEngine(client, metrics)
    app = build_app(engine, model_name=spec.model_name, api_key=spec.api_key, options=spec.options)
    sock = reuseport_socket(spec.host, spec.port)
    config = uvicorn.Config(app, host=spec.host, port=spec.port, log_level=spec.log_level.lower(), access_log=False,
                            timeout_graceful_shutdown=spec.options.shutdown_timeout_s + 1.0)
    server = _ApiServer(config, engine, spec.options.shutdown_timeout_s)
    server.index = index
    engine.on_failure = server.engine_failed
    try:
        server.run(sockets=[sock])
    finally:
        engine.shutdown()  # no-op when the lifespan already stopped it
        sock.close()
    code = server.exit_code if server.started else 1
    logger.info("api server %d exits with status %d", index, code)
    exit_now(code)

