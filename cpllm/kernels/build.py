"""Compile a C kernel of this package for this machine, and open it with ctypes (cpllm/kernels/library.py asks).

The shared library is built with the system C compiler (`$CC`, else `cc`) at `-O3 -march=native -fopenmp` into a
cache directory (`$CPLLM_KERNEL_CACHE`, else `~/.cache/cpllm/kernels`), under a name that hashes the sources and
headers of the package (a kernel may #include its siblings), the flags, the compiler's version and the CPU's feature
flags, so a changed source or another machine builds its own. Concurrent ranks may build the same file: each
compiles to a private name and renames it into place (atomic), so a reader never sees half a library. The library
links libgomp; loaded after torch, it shares the OpenMP runtime (and thread pool) torch already loaded, because the
runtime's soname is the same.

A missing compiler or a failed build logs a WARNING with the reason, and the kernel's callers run their torch
fallbacks (library.py asks once per process and library).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno", "-std=gnu11")
"""Compiler flags; `-march=native` is why each machine builds its own library."""

def _cache_dir() -> Path:
    default = Path.home() / ".cache" / "cpllm" / "kernels"
    return Path(os.environ.get("CPLLM_KERNEL_CACHE", default))


def _compiler() -> str:
    return os.environ.get("CC", "cc")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _build_key(source: bytes) -> str:
    """A hash of the source, every other kernel source and header (a kernel may #include them), the flags, the
    compiler's version and the CPU's flags."""
    version = subprocess.run([_compiler(), "--version"], capture_output=True, text=True, check=True).stdout
    folder = Path(__file__).parent
    siblings = b"".join(path.read_bytes() for path in sorted([*folder.glob("*.c"), *folder.glob("*.h")]))
    digest = hashlib.sha256(source + siblings + " ".join(FLAGS).encode() + version.encode() + _cpu_flags().encode())
    return digest.hexdigest()[:16]


def _compile(source_path: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, private = tempfile.mkstemp(prefix=target.stem + ".", suffix=".so.tmp", dir=target.parent)
    os.close(fd)
    try:
        command = [_compiler(), *FLAGS, "-o", private, str(source_path), "-lm"]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr.strip()}")
        os.replace(private, target)
    finally:
        if os.path.exists(private):
            os.unlink(private)


def open_built(name: str) -> ctypes.CDLL | None:
    """The library built from cpllm/kernels/<name>.c (compiled first where this machine has none yet), or None
    where it cannot be built (logged)."""
    source_path = Path(__file__).with_name(f"{name}.c")
    try:
        target = _cache_dir() / f"{name}-{_build_key(source_path.read_bytes())}.so"
        if not target.exists():
            _compile(source_path, target)
        return ctypes.CDLL(str(target))
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        logger.warning("kernel %s not built (%s); using its torch fallback. Logged once.", name, error)
        return None
