"""The first code a spawned rank runs: `python -m cpllm.distributed.rank_entry RANK CONTROL_FD`.

A fresh interpreter, not multiprocessing's spawn: spawn re-imports the parent's
`__main__`, so a user's script without an `if __name__ == "__main__":` guard
would start the engine again in every child and die in its bootstrapping phase.
This module imports nothing of the user's.

Protocol with the driver (see `rank_processes.py`):
* stdin carries two length-prefixed pickles: the driver's `sys.path` (plain
  strings, safe to read before any import), then `(function, args, env)`;
  stdin then stays open, and its end of file means the driver is gone, even
  after a SIGKILL, so the rank exits at once;
* CONTROL_FD is a pipe to the driver: ("started", None) once the function is
  imported, ("error", traceback) if anything raises, so the driver can name
  this rank's own error within moments instead of waiting out a store timeout.
"""

from __future__ import annotations

import os
import pickle
import struct
import sys
import threading
import traceback
from multiprocessing.connection import Connection

PARENT_DIED_EXIT_CODE = 75
"""Exit status of a spawned rank that stopped because its driver went away."""

_FRAME_HEADER = struct.Struct("<Q")


def write_frame(stream, payload: bytes) -> None:
    stream.write(_FRAME_HEADER.pack(len(payload)) + payload)


def _read_exactly(fd: int, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = os.read(fd, size - len(data))
        if not chunk:
            raise EOFError("the driver closed the pipe before sending this rank's start-up data")
        data += chunk
    return data


def read_frame(fd: int) -> bytes:
    (length,) = _FRAME_HEADER.unpack(_read_exactly(fd, _FRAME_HEADER.size))
    return _read_exactly(fd, length)


def _exit_when_driver_dies(fd: int) -> None:
    # Raw reads of the descriptor: a daemon thread blocked inside sys.stdin's buffered
    # reader would hold its lock at interpreter shutdown, a fatal error.
    def watch() -> None:
        while os.read(fd, 4096):
            pass  # the driver never writes after the payload; only end of file matters
        os._exit(PARENT_DIED_EXIT_CODE)

    threading.Thread(target=watch, name="cpllm-driver-watch", daemon=True).start()


def main() -> None:
    rank, control = int(sys.argv[1]), Connection(int(sys.argv[2]), readable=False)
    stdin = sys.stdin.fileno()
    try:
        sys.path[:] = pickle.loads(read_frame(stdin))
        function, args, env = pickle.loads(read_frame(stdin))  # imports the function's module
        _exit_when_driver_dies(stdin)
        os.environ.update(env)
        control.send(("started", None))
        function(rank, *args)
    except SystemExit:
        raise
    except BaseException:
        text = traceback.format_exc()
        print(f"cpllm worker rank {rank} failed:\n{text}", file=sys.stderr, flush=True)
        try:
            control.send(("error", text))
        except OSError:
            pass  # the driver is gone already
        os._exit(1)
    # The rank has left its process group and released what it shares; the interpreter's own teardown (torch's
    # finalizers, about a second) would only delay the driver's join, and a server's --shutdown-timeout with it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
