"""Build a C kernel source beside this file into a shared library at first use, cache it, load it.

The library is compiled with the system C compiler (``$CC`` or ``gcc``, ``-O3 -march=native
-fopenmp`` plus the kernel's own flags) into ``$QWORKER_CACHE_DIR/kernels/<hash>/`` (default
``~/.cache/qworker``) and loaded with ctypes. The hash covers the source, the flags, the compiler
version and the CPU, so a cache shared between machines never hands one a library built for
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
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

BASE_CFLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-std=gnu11")
OPENMP_FLAG = "-fopenmp"


def cache_root() -> Path:
    root = os.environ.get("QWORKER_CACHE_DIR") or os.path.join(Path.home(), ".cache", "qworker")
    return Path(root) / "kernels"


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


def _build_and_load(compiler: str, version: str, flags: Sequence[str], source: Path) -> ctypes.CDLL:
    key = hashlib.sha256()
    for part in (source.read_bytes(), " ".join(flags).encode(), version.encode(), cpu_fingerprint().encode()):
        key.update(part)
        key.update(b"\0")
    target = cache_root() / key.hexdigest()[:24] / source.with_suffix(".so").name
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
