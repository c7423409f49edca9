"""Compile a C kernel of this package for this machine on first use, and load it with ctypes.

The shared library is built with the system C compiler (`$CC`, else `cc`) at `-O3 -march=native -fopenmp` into a
cache directory (`$CPLLM_KERNEL_CACHE`, else `~/.cache/cpllm/kernels`), under a name that hashes the sources and
headers of the package (a kernel may #include its siblings), the flags, the compiler's version and the CPU's feature
flags, so a changed source or another machine builds its own. Concurrent ranks may build the same file: each
compiles to a private name and renames it into place (atomic), so a reader never sees half a library. The library
links libgomp; loaded after torch, it shares the OpenMP runtime (and thread pool) torch already loaded, because the
runtime's soname is the same.

`CPLLM_KERNELS=0` turns every kernel off (the torch fallbacks run); a missing compiler or a failed build logs
one WARNING with the reason and falls back the same way.
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

_loaded: dict[str, ctypes.CDLL | None] = {}
"""Kernel name -> its library, or None when it could not be built (the reason was logged once)."""


def enabled() -> bool:
    """False when CPLLM_KERNELS=0 asks for the torch fallbacks."""
    return os.environ.get("CPLLM_KERNELS", "1") != "0"


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


def load_typed(name: str, signatures: dict[str, tuple[list | None, object]]) -> ctypes.CDLL | None:
    """`load(name)` with each named function's (argtypes, restype) declared, once per loaded library."""
    lib = load(name)
    if lib is not None and not hasattr(lib, "_cpllm_typed"):
        for function, (argtypes, restype) in signatures.items():
            if argtypes is not None:
                getattr(lib, function).argtypes = argtypes
            getattr(lib, function).restype = restype
        lib._cpllm_typed = True
    return lib


def load(name: str) -> ctypes.CDLL | None:
    """The library built from cpllm/kernels/<name>.c, or None (kernels off, or no build: logged once)."""
    if not enabled():
        return None
    if name not in _loaded:
        source_path = Path(__file__).with_name(f"{name}.c")
        try:
            target = _cache_dir() / f"{name}-{_build_key(source_path.read_bytes())}.so"
            if not target.exists():
                _compile(source_path, target)
            _loaded[name] = ctypes.CDLL(str(target))
        except (OSError, RuntimeError, subprocess.SubprocessError) as error:
            logger.warning("kernel %s not built (%s); using its torch fallback. Logged once.", name, error)
            _loaded[name] = None
    return _loaded[name]
