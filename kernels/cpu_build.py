"""Build a C kernel source beside this file into a shared library at first use, cache it, load it.

The library is compiled with the system C compiler (``$CC`` or ``gcc``, ``-O3 -march=native
-fopenmp`` plus the kernel's own flags) into ``$QWORKER_CACHE_DIR/kernels/<hash>/`` (default
``~/.cache/qworker``) and loaded with ctypes. The hash covers the source and every header it
includes with quotes (cpu_simd.h), the flags, the compiler version and the CPU, so a changed header
rebuilds its kernels and a cache shared between machines never hands one a library built for
another. Where the compiler has no OpenMP the kernel is built without it and runs on one thread.
Its library resolves ``libgomp.so.1`` to the copy torch already loaded, so both share one thread
pool.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

from qworker_kernels import envs

logger = logging.getLogger(__name__)

_QUOTED_INCLUDE = re.compile(rb'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)

BASE_CFLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-std=gnu11")
OPENMP_FLAG = "-fopenmp"


def cache_root() -> Path:
    return envs.cache_dir() / "kernels"


def cpu_fingerprint() -> str:
    # -march=native builds for this CPU: the model name and feature flags name it.
    lines = [platform.machine(), platform.processor()]
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key = line.split(":", 1)[0].strip()
                if key in ("model name", "flags", "Features", "CPU part") and line not in lines:
                    lines.append(line)
    except OSError:
        pass
    return "\n".join(lines)


def _compile(compiler: str, flags: Sequence[str], source: Path, target: Path) -> None:
    """Builds into a temporary file then renames it, so concurrent processes never load half a file."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run(
            [compiler, *flags, "-o", tmp, str(source)], capture_output=True, text=True, timeout=120
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{compiler} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def source_closure(source: Path) -> list[Path]:
    """`source` and every file it includes with quotes, recursively, resolved beside the including
    file (as the compiler resolves them); sorted after the source, so the order is stable."""
    seen: dict[Path, None] = {}
    pending = [source]
    while pending:
        path = pending.pop()
        if path in seen:
            continue
        seen[path] = None
        for name in _QUOTED_INCLUDE.findall(path.read_bytes()):
            included = path.parent / name.decode()
            if included.exists():  # a missing header fails the compile, with the compiler's message
                pending.append(included)
    return [source, *sorted(p for p in seen if p != source)]


def build_key(source: Path, flags: Sequence[str], compiler_version: str) -> str:
    """The cache key of `source` built with `flags` by this compiler on this CPU."""
    key = hashlib.sha256()
    parts = [path.name.encode() + b"\0" + path.read_bytes() for path in source_closure(source)]
    for part in (*parts, " ".join(flags).encode(), compiler_version.encode(), cpu_fingerprint().encode()):
        key.update(part)
        key.update(b"\0")
    return key.hexdigest()[:24]


def _build_and_load(compiler: str, version: str, flags: Sequence[str], source: Path) -> ctypes.CDLL:
    target = cache_root() / build_key(source, flags, version) / source.with_suffix(".so").name
    if target.exists():
        try:
            return ctypes.CDLL(str(target))
        except OSError as e:  # a damaged cache entry: build it again
            logger.warning("rebuilding %s: %s", target, e)
    _compile(compiler, flags, source, target)
    return ctypes.CDLL(str(target))


def load_c_library(source: Path, extra_flags: Sequence[str] = ()) -> ctypes.CDLL | None:
    """The compiled `source`, built on first use; None (and a warning) when it cannot be built."""
    name = source.stem
    compiler = shutil.which(os.environ.get("CC", "gcc"))
    if compiler is None:
        logger.warning("no C compiler found; %s uses its torch fallback", name)
        return None
    try:
        version = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, timeout=30, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError) as e:
        logger.warning("C compiler %s unusable, %s uses its torch fallback: %s", compiler, name, e)
        return None
    for flags in ((*BASE_CFLAGS, *extra_flags, OPENMP_FLAG), (*BASE_CFLAGS, *extra_flags)):
        try:
            return _build_and_load(compiler, version, flags, source)
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            logger.warning("%s build failed with %s: %s", name, " ".join(flags), e)
    logger.warning("%s uses its torch fallback", name)
    return None


class CKernelLibrary:
    """One C source of this folder, built and loaded at first use, with the ctypes argument types of
    the functions it exports (each returns an int status: 0, or a code that `errors` explains).

    Loading happens once per process (under a lock: the engine and helper threads may ask at once);
    when it fails, every later call sees None, and callers take their torch path.
    """

    def __init__(
        self,
        source_name: str,
        signatures: Mapping[str, Sequence[type]],
        errors: Mapping[int, tuple[type[Exception], str]],
        extra_flags: Sequence[str] = (),
    ) -> None:
        self.source = Path(__file__).with_name(source_name)
        self.signatures = dict(signatures)
        self.errors = dict(errors)
        self.extra_flags = tuple(extra_flags)
        self._lock = threading.Lock()
        self._is_loaded = False
        self._library: ctypes.CDLL | None = None

    def get(self) -> ctypes.CDLL | None:
        """The loaded library, or None (with a warning, once) when it cannot be built."""
        with self._lock:
            if not self._is_loaded:
                self._library = self._load()
                self._is_loaded = True
            return self._library

    def _load(self) -> ctypes.CDLL | None:
        lib = load_c_library(self.source, self.extra_flags)
        if lib is None:
            return None
        for name, argtypes in self.signatures.items():
            fn = getattr(lib, name)
            fn.argtypes = list(argtypes)
            fn.restype = ctypes.c_int
        return lib

    def is_available(self) -> bool:
        return self.get() is not None

    def require(self) -> ctypes.CDLL:
        lib = self.get()
        if lib is None:
            raise RuntimeError(f"the C kernel {self.source.name} could not be built; use the torch path")
        return lib

    def check(self, caller: str, status: int) -> None:
        """Raises the error that `status` (a return code of the library) stands for."""
        if status != 0:
            error, message = self.errors.get(status, (RuntimeError, f"error code {status}"))
            raise error(f"{caller}: {message}")
