"""Rows between instances on one host through shared memory instead of TCP (torch-free).

The consumer rank asks for a move's rows with its host key; a producer rank on the same host (the same kernel and
the same /dev/shm) writes them into one file of /dev/shm and answers its name, and the consumer maps it, copies
the rows into its pools and removes it. Elsewhere, or where the file cannot be made, the rows travel in the
answer's frames as over TCP. A file whose consumer never removed it (the consumer died between answer and read)
is removed by its producer once it is older than its expiry, and every file of a producer when it closes.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import time
import uuid
from collections.abc import Iterator

SHM_DIR = "/dev/shm"
PREFIX = "cpllm-kv-"


def host_key() -> str | None:
    """Same on two processes exactly when they share a kernel and a /dev/shm; None where there is none."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        shm = os.stat(SHM_DIR)
    except OSError:
        return None
    return f"{boot}:{shm.st_dev}:{shm.st_ino}"


class ShmWriter:
    """A producer rank's files: each answer's rows in one file, removed by the reader or at expiry."""

    def __init__(self, expiry_s: float):
        self.expiry_s = expiry_s
        self._made: dict[str, float] = {}
        self._lock = threading.Lock()

    def write(self, frames: list) -> str | None:
        """The frames' bytes one after another in a new file; its name, or None where it could not be made."""
        self._sweep()
        total = sum(len(memoryview(frame).cast("B")) for frame in frames)
        name = f"{PREFIX}{uuid.uuid4().hex}"
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except OSError:
            return None
        try:
            os.ftruncate(fd, max(total, 1))
            with mmap.mmap(fd, max(total, 1)) as area:
                offset = 0
                for frame in frames:
                    data = memoryview(frame).cast("B")
                    area[offset:offset + len(data)] = data
                    offset += len(data)
        except OSError:
            os.close(fd)
            _remove(path)
            return None
        os.close(fd)
        with self._lock:
            self._made[name] = time.monotonic()
        return name

    def _sweep(self) -> None:
        now = time.monotonic()
        with self._lock:
            old = [name for name, made in self._made.items() if now - made > self.expiry_s]
            for name in old:
                del self._made[name]
        for name in old:
            _remove(os.path.join(SHM_DIR, name))

    def close(self) -> None:
        with self._lock:
            names, self._made = list(self._made), {}
        for name in names:
            _remove(os.path.join(SHM_DIR, name))


@contextlib.contextmanager
def mapped_frames(name: str, sizes: list[int]) -> Iterator[list[memoryview]]:
    """The frames `ShmWriter.write` wrote under `name` (their byte sizes in order), read in place while the block
    runs; the file is removed after it, whatever happens."""
    if not name.startswith(PREFIX) or os.sep in name:
        raise ValueError(f"shared-memory rows {name!r}: not a name this transfer writes")
    path = os.path.join(SHM_DIR, name)
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), max(sum(sizes), 1), access=mmap.ACCESS_READ) as area:
            view, frames, offset = memoryview(area), [], 0
            for size in sizes:
                frames.append(view[offset:offset + size])
                offset += size
            try:
                yield frames
            finally:
                for frame in frames:
                    frame.release()
                view.release()
    finally:
        _remove(path)


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
