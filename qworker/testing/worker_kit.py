"""Helpers for tests of the worker (and for anyone testing code that uses qworker's queue).

Tests use the Redis server that $QWORKER_TEST_REDIS_URL names, else one this process starts on a
free loopback port (tests/conftest.py starts one per test process and names it there), and give
every test its own stream, group and key prefix so that tests never see each other's jobs. They
never touch a server they did not start (127.0.0.1:6379 included) unless the variable names it.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from qworker import envs
from qworker.backends.redis.server import RedisServer

# What the suite's helpers use (XINFO STREAM's entries-added, for one): the check says so at start.
MIN_TEST_REDIS_VERSION = (7, 0)

_private_redis: RedisServer | None = None


def start_private_redis() -> RedisServer:
    """A redis-server on a free loopback port, stopped (and its folder removed) when this process
    exits."""
    data_dir = Path(tempfile.mkdtemp(prefix="qwtest-redis-"))
    server = RedisServer(data_dir, appendonly=False).start()

    def stop() -> None:
        server.stop()
        shutil.rmtree(data_dir, ignore_errors=True)

    atexit.register(stop)  # stopping twice is harmless: the suite's conftest stops it first
    return server


def redis_base_url(db: int = 0) -> str:
    """The tests' Redis, database `db`: $QWORKER_TEST_REDIS_URL's server, else this process's own."""
    global _private_redis
    url = envs.QWORKER_TEST_REDIS_URL.get()
    if url is None:
        if _private_redis is None:
            _private_redis = start_private_redis()
        url = _private_redis.url
    base = url.split("?", 1)[0].rstrip("/")
    if base.rsplit("/", 1)[-1].isdigit():
        base = base.rsplit("/", 1)[0]
    return f"{base}/{db}"


def unique_url(base: str, tag: str = "test") -> str:
    """A queue-and-results URL with a stream, group and prefix no other test uses."""
    name = f"qwtest:{tag}:{uuid.uuid4().hex[:10]}"
    sep = "&" if "?" in base else "?"
    return f"{base}{sep}stream={name}&group=g&prefix={name}"


def cleanup(redis: Any, url: str) -> None:
    """Delete every key of a unique_url (stream, dead letters, results, deltas)."""
    from qworker.backends.connections import SINK_PARAMS, SOURCE_PARAMS, parse_url

    prefix = parse_url(url, SOURCE_PARAMS | SINK_PARAMS).params["prefix"]
    keys = list(redis.scan_iter(match=f"{prefix}*", count=1000))
    for i in range(0, len(keys), 500):
        redis.delete(*keys[i : i + 500])


def write_tiny_model_dir(target: Path, **config_overrides: Any) -> Path:
    """A tiny random Llama with the SmolLM2 tokenizer, saved as a Hugging Face directory, so that
    worker subprocesses start in seconds with `--model target`."""
    from qworker.model.loader import resolve_model
    from qworker.testing.tiny_model import tiny_llama_model

    if (target / "config.json").is_file():
        return target
    tokenizer_dir = resolve_model("smollm2").path
    # The SmolLM2 tokenizer's vocabulary; rms_norm_eps 1e-6 is what this model has always had
    # (LlamaConfig's default), so that tests keep the weights and outputs they were written with.
    args: dict[str, Any] = dict(
        vocab_size=49152,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
    )
    model = tiny_llama_model(seed=0, **(args | config_overrides))
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target, safe_serialization=True)
    for name in os.listdir(tokenizer_dir):
        if name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
            shutil.copy(Path(tokenizer_dir) / name, target / name)
    return target


def spawn_worker(url: str, model_dir: Path, name: str, *extra_args: str, log_path: Path) -> subprocess.Popen:
    """Start `qworker worker` in a subprocess and wait until it says it is ready."""
    log = open(log_path, "w")  # noqa: SIM115 - the process owns it
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "qworker.cli",
            "worker",
            "--queue",
            url,
            "--model",
            str(model_dir),
            "--name",
            name,
            "--dtype",
            "float32",
            "--device",
            "cpu",
            *extra_args,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"},
        # A group of its own: a finalizer can kill it and anything it started (kill_group).
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if f"worker {name} ready" in log_path.read_text():
            return process
        if process.poll() is not None:
            raise RuntimeError(f"worker {name} exited early:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.1)
    kill_group(process)
    raise TimeoutError(f"worker {name} did not start:\n{log_path.read_text()[-3000:]}")


def kill_group(process: subprocess.Popen) -> None:
    """SIGKILL a process started with start_new_session (spawn_worker's) and its whole group, and
    reap it: for finalizers, which must leave nothing running whatever the test did."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=10)


def processes_with_env(name: str, value: str) -> dict[int, str]:
    """pid -> command line of this machine's processes started with `name=value` in their
    environment (read from /proc; what a process inherited at exec, whatever it changed since)."""
    wanted = f"{name}={value}".encode()
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if wanted not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            status = (entry / "status").read_text()
        except OSError:
            continue  # exited meanwhile, or not ours to read
        if "\nState:\tZ" in status:
            continue  # a zombie: dead, waiting for its parent to reap it
        found[int(entry.name)] = cmdline
    return found


def kill_processes_with_env(
    name: str, value: str, timeout_s: float = 10.0, *, keep: frozenset[int] = frozenset()
) -> dict[int, str]:
    """SIGKILL the processes `processes_with_env` finds, but those in `keep`, and wait for them;
    what was killed."""

    def found() -> dict[int, str]:
        return {pid: cmd for pid, cmd in processes_with_env(name, value).items() if pid not in keep}

    victims = found()
    for pid in victims:
        with contextlib.suppress(ProcessLookupError):  # exited meanwhile
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while found() and time.monotonic() < deadline:
        time.sleep(0.05)
    return victims
