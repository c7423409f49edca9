"""A `cpllm serve` child process on loopback, for tests and benchmarks: start, wait until healthy, stop."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import httpx


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m cpllm serve ARGS --port P`; its output goes to a temporary log file (read it on failure)."""

    def __init__(self, args: list[str], *, port: int | None = None, env: dict[str, str] | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.NamedTemporaryFile("w+", prefix="cpllm-serve-", suffix=".log", delete=False)
        command = [sys.executable, "-m", "cpllm", "serve", *args, "--host", "127.0.0.1", "--port", str(self.port)]
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT,
                                        env={**os.environ, **(env or {})}, start_new_session=True)

    @classmethod
    @contextlib.contextmanager
    def running(cls, args: list[str], *, timeout_s: float = 120.0, **options) -> Iterator["ServerProcess"]:
        """A server that is healthy inside the block and closed after it, also when it never became healthy."""
        server = cls(args, **options)
        try:
            yield server.wait_ready(timeout_s)
        finally:
            server.close()

    def log(self) -> str:
        with open(self._log.name, encoding="utf-8", errors="replace") as f:
            return f.read()

    def wait_ready(self, timeout_s: float = 120.0) -> "ServerProcess":
        """Polls /health until 200; raises with the server's log if it dies or the time runs out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}:\n{self.log()[-4000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"the server was not healthy after {timeout_s:.0f} s:\n{self.log()[-4000:]}")

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, then SIGKILL to its process group if still running after `timeout_s`; returns the exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                # its own session: this takes the worker ranks it spawned down with it
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
        return self.process.returncode

    def close(self) -> None:
        self.stop()
        self._log.close()
        os.unlink(self._log.name)
