"""Start `python -m cpllm serve` for `cpllm bench serve` when no --url is given, and stop it afterwards."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx

from cpllm.distributed.launch import find_free_port


def wait_ready(url: str, process: subprocess.Popen, timeout_s: float) -> None:
    """Poll /v1/models until the server answers; fail early if it exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with status {process.returncode} before it was ready")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/v1/models", timeout=2.0).status_code == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(f"the server at {url} was not ready within {timeout_s:.0f} s")


@contextlib.contextmanager
def launched_server(flags: list[str], *, ready_timeout_s: float = 300.0,
                    log_path: str | None = None) -> Iterator[str]:
    """Run a cpllm server on a free local port for the duration of the block; yields its base URL."""
    port = find_free_port()
    command = [sys.executable, "-m", "cpllm", "--log-level", "WARNING", "serve", "--port", str(port), *flags]
    log = open(log_path or os.devnull, "w")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, process, ready_timeout_s)
        yield url
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        log.close()
