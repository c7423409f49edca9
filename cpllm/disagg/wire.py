"""The ZeroMQ exchanges of a transfer: one JSON header frame, then raw byte frames (torch-free).

A server is a REP socket answered by one daemon thread; a call opens a REQ socket, sends, waits at most the
timeout for the answer and closes (so a lost peer costs one timeout, never a hung socket)."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from typing import Any

import zmq

logger = logging.getLogger(__name__)

Handler = Callable[[dict, list[bytes]], tuple[dict, list]]
"""(header, frames) -> (answer header, answer frames: bytes or buffers)."""


class TransferError(RuntimeError):
    """A peer did not answer in time, or answered with an error."""


def call(host: str, port: int, header: dict, frames: list | None = None, *, timeout_s: float) -> tuple[dict, list]:
    """Send one request to host:port and return its answer; TransferError after `timeout_s` seconds."""
    context = zmq.Context.instance()
    sock = context.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://{host}:{port}")
        sock.send_multipart([json.dumps(header).encode(), *(frames or [])], copy=False)
        if not sock.poll(int(timeout_s * 1000), zmq.POLLIN):
            raise TransferError(f"no answer from {host}:{port} to {header.get('op')!r} within {timeout_s} s")
        parts = sock.recv_multipart(copy=False)
    finally:
        sock.close()
    answer = json.loads(parts[0].bytes)
    if "error" in answer:
        raise TransferError(f"{host}:{port} refused {header.get('op')!r}: {answer['error']}")
    return answer, [p.buffer for p in parts[1:]]


class Server:
    """Answers requests on tcp://host:port with `handler`, one at a time, on a daemon thread."""

    def __init__(self, host: str, port: int, handler: Handler, name: str):
        self._sock = zmq.Context.instance().socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(f"tcp://{host}:{port}")
        self._handler, self._stop = handler, threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(100, zmq.POLLIN):
                continue
            parts = self._sock.recv_multipart()
            try:
                header, frames = self._handler(json.loads(parts[0]), parts[1:])
            except Exception as error:  # the peer learns why; this server keeps serving
                logger.exception("kv transfer request failed")
                header, frames = {"error": f"{type(error).__name__}: {error}"}, []
            self._sock.send_multipart([json.dumps(header).encode(), *frames], copy=False)
        self._sock.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def as_json(value: Any) -> Any:
    """Plain JSON of a plan's pieces (ranges become [start, stop])."""
    if isinstance(value, range):
        return [value.start, value.stop]
    if isinstance(value, (list, tuple)):
        return [as_json(v) for v in value]
    return value
