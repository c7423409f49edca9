"""`cpllm serve --api-server-count N` (N > 1): one engine, N HTTP processes on one port, as vLLM scales its front.

This process builds the engine once (its ranks, or its DP replicas, start here as with one API server), holds the
port bound, starts N API-server processes (api_server.py), each of which binds the port with SO_REUSEPORT so the
kernel spreads connections over them, and then runs the engine's step loop for all of them (engine_hub.py).
Every API process parses, tokenizes, renders and streams on its own CPU; the engine sees one stream of requests.

Life: SIGTERM or SIGINT here is passed on as SIGTERM to every API server, which drains (--shutdown-timeout) while
the engine keeps stepping for it; once all have exited the engine and its ranks stop and this process exits 0.
An API server that exits on its own takes the others down the same way (status 1, as vLLM does); an engine that
fails tells every API server (they exit 3) and this process exits 3. The API servers watch this process through
their stdin (rank_entry), so they exit even if it is killed with SIGKILL: nothing is left behind.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import tempfile
import threading
import time

from cpllm.distributed.rank_processes import RankProcess, describe_exit, start_process
from cpllm.engine.llm import LLM
from cpllm.server.api_server import ApiServerSpec, api_server_main, reuseport_socket
from cpllm.server.engine_client import EngineLimits
from cpllm.server.engine_hub import EngineHub
from cpllm.server.http_server import ENGINE_FAILED_EXIT, exit_now
from cpllm.server.options import ServeOptions, served_model_name

logger = logging.getLogger(__name__)

SUPERVISE_S = 0.05
"""How often the main thread looks at the API servers and at a signal it got."""
KILL_GRACE_S = 5.0
"""After SIGTERM, API servers get --shutdown-timeout plus this long to exit before they are killed."""


class ApiServers:
    """The API-server processes: started, watched from the step loop, stopped together."""

    def __init__(self, spec: ApiServerSpec):
        env = {"PROMETHEUS_MULTIPROC_DIR": spec.metrics_dir}  # read when prometheus_client is imported
        self.processes: list[RankProcess] = [start_process(i, api_server_main, (spec,), env)
                                             for i in range(spec.count)]
        self._drain_s = spec.options.shutdown_timeout_s + KILL_GRACE_S
        self.stop_asked: str | None = None
        """Why every API server was told to stop (a signal, one's exit), or None while they serve."""
        self.exit_code = 0
        self.signalled: str | None = None
        """The signal this process got (set by its handler; acted on by `done`, outside the handler)."""
        self._deadline: float | None = None

    def ask_stop(self, why: str, exit_code: int = 0) -> None:
        """SIGTERM to every API server still running (once); they drain and exit."""
        if self.stop_asked is not None:
            return
        self.stop_asked, self.exit_code = why, exit_code
        logger.info("%s: stopping %d API server(s); requests in flight get %g s", why, len(self.processes),
                    self._drain_s - KILL_GRACE_S)
        self._deadline = time.monotonic() + self._drain_s
        for process in self.processes:
            if process.exitcode is None:
                process.popen.send_signal(signal.SIGTERM)

    def done(self) -> bool:
        """Called by the step loop: True once every API server has exited (killing them at the deadline)."""
        if self.stop_asked is None and self.signalled is not None:
            self.ask_stop(self.signalled)
        if self.stop_asked is None:
            for index, process in enumerate(self.processes):
                if process.exitcode is not None:
                    code = ENGINE_FAILED_EXIT if process.exitcode == ENGINE_FAILED_EXIT else 1
                    self.ask_stop(f"api server {index} (pid {process.pid}) {describe_exit(process.exitcode)}", code)
                    break
            return False
        if all(process.exitcode is not None for process in self.processes):
            return True
        if time.monotonic() > self._deadline:
            self.kill()
            return True
        return False

    def kill(self) -> None:
        for index, process in enumerate(self.processes):
            if process.exitcode is None:
                logger.error("api server %d (pid %d) did not exit in time: killing it", index, process.pid)
                process.kill()

    def reap(self) -> None:
        self.kill()
        for process in self.processes:
            process.join(5.0)
            process.close()


def _supervise(hub: EngineHub, servers: ApiServers) -> int:
    """The engine's step loop on its own thread (as AsyncEngine runs it with one API server: a step on the main
    thread was an order of magnitude slower here, its OpenMP team fighting the other processes for the cores),
    while this thread takes signals and watches the API servers; returns the exit status."""
    stop = threading.Event()
    failed: list[BaseException] = []

    def step_loop() -> None:
        try:
            hub.serve(stop.is_set)
        except BaseException as exc:  # noqa: BLE001 - the hub told the API servers; they exit on their own
            failed.append(exc)

    thread = threading.Thread(target=step_loop, name="cpllm-engine", daemon=True)
    thread.start()
    while not servers.done():
        if failed:
            servers.ask_stop(f"the engine failed ({failed[0]})", ENGINE_FAILED_EXIT)
        time.sleep(SUPERVISE_S)
    stop.set()
    thread.join(60.0)
    return ENGINE_FAILED_EXIT if failed else servers.exit_code


def run_api_servers(args: argparse.Namespace, options: ServeOptions, kwargs: dict) -> None:
    """Serves until SIGTERM / SIGINT, an API server's exit or the engine's failure; then ends the process."""
    llm = LLM(args.model_path or args.model, **kwargs)  # other ranks never return from here
    holder = reuseport_socket(args.host, args.port)  # bound, never listening: the port stays ours (and known, for
    port = holder.getsockname()[1]  # --port 0) while the API servers start and until they have all exited
    engine = llm.engine
    name = served_model_name(args, engine.config.model_path)
    hub = EngineHub(engine, options.api_server_count)
    metrics_dir = tempfile.mkdtemp(prefix="cpllm-metrics-")
    limits = EngineLimits(max_model_len=engine.max_model_len, kv_capacity_tokens=engine.kv_capacity_tokens,
                          capacity_bounds_length=getattr(engine, "_capacity_bounds_length", True),
                          eos_token_ids=tuple(getattr(engine, "eos_token_ids", ()) or engine.tokenizer.eos_token_ids))
    api_key = args.api_key or os.environ.get("VLLM_API_KEY") or None
    spec = ApiServerSpec(count=options.api_server_count, config=engine.config, limits=limits,
                         addresses=hub.addresses, model_name=name, api_key=api_key, options=options, host=args.host,
                         port=port, log_level=args.log_level, metrics_dir=metrics_dir)
    code = 1
    servers = None
    try:
        servers = ApiServers(spec)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda number, _frame: setattr(servers, "signalled", signal.Signals(number).name))
        logger.info("serving %r (max_model_len=%d) on http://%s:%d/v1 through %d API server processes", name,
                    engine.max_model_len, args.host, port, options.api_server_count)
        code = _supervise(hub, servers)
    finally:
        if servers is not None:
            servers.reap()
        engine.shutdown()
        hub.close()
        holder.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)
    logger.info("exiting with status %d", code)
    exit_now(code)
