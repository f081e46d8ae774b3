"""A private RabbitMQ node for tests: its own port, node name, data and log directories and
config (no plugins), started from the installed rabbitmq-server and stopped (or restarted) by the
test. The machine's shared server is never touched. Started once per session (about 10 s on a
loaded 2-core machine), so the tests do not depend on a server at 5672.

TLS: `with_tls=True` makes a self-signed CA and server certificate with openssl and adds a TLS
listener on a second port.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from qworker.testing.worker_kit import kill_processes_with_env

RABBITMQ_SERVER = "/usr/lib/rabbitmq/bin/rabbitmq-server"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def is_available() -> bool:
    return Path(RABBITMQ_SERVER).exists() and shutil.which("erl") is not None


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def make_tls_files(directory: Path) -> dict[str, Path]:
    """A self-signed CA and a server certificate for 127.0.0.1 / localhost."""
    ca_key, ca_cert = directory / "ca.key", directory / "ca.pem"
    key, csr, cert = directory / "server.key", directory / "server.csr", directory / "server.pem"
    ext = directory / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    run = lambda *args: subprocess.run(["openssl", *args], check=True, capture_output=True)
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(ca_key), "-out", str(ca_cert),
        "-days", "2", "-subj", "/CN=qworker-test-ca")  # fmt: skip
    run(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        str(key),
        "-out",
        str(csr),
        "-subj",
        "/CN=localhost",
    )
    run("x509", "-req", "-in", str(csr), "-CA", str(ca_cert), "-CAkey", str(ca_key), "-CAcreateserial",
        "-out", str(cert), "-days", "2", "-extfile", str(ext))  # fmt: skip
    for path in (key, cert, ca_cert):
        path.chmod(0o644)
    return {"ca": ca_cert, "cert": cert, "key": key}


class RabbitNode:
    def __init__(self, *, with_tls: bool = False, consumer_timeout_ms: int | None = None) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="qwtest-rabbit-"))
        self.port = free_port()
        self.dist_port = free_port()
        # An epmd of this node's own (the node starts it as a daemon): close() can stop it without
        # touching the machine's epmd, which other nodes share.
        self.epmd_port = free_port()
        self.tls_port = free_port() if with_tls else None
        self.name = f"qwtest-{os.getpid()}-{self.port}@localhost"
        self.tls_files = make_tls_files(self.dir) if with_tls else None
        lines = [f"listeners.tcp.default = {self.port}", "loopback_users = none"]
        if consumer_timeout_ms is not None:
            lines.append(f"consumer_timeout = {consumer_timeout_ms}")
        if self.tls_files is not None:
            lines += [
                f"listeners.ssl.default = {self.tls_port}",
                f"ssl_options.cacertfile = {self.tls_files['ca']}",
                f"ssl_options.certfile = {self.tls_files['cert']}",
                f"ssl_options.keyfile = {self.tls_files['key']}",
                "ssl_options.verify = verify_none",
                "ssl_options.fail_if_no_peer_cert = false",
            ]
        (self.dir / "rabbit.conf").write_text("\n".join(lines) + "\n")
        (self.dir / "enabled_plugins").write_text("[].\n")
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}/"

    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "HOME": str(self.dir),
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "ERL_EPMD_PORT": str(self.epmd_port),
            "RABBITMQ_NODENAME": self.name,
            "RABBITMQ_MNESIA_BASE": str(self.dir / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.dir / "log"),
            "RABBITMQ_CONFIG_FILE": str(self.dir / "rabbit"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.dir / "enabled_plugins"),
            "RABBITMQ_PID_FILE": str(self.dir / "pid"),
            "ERL_CRASH_DUMP": str(self.dir / "erl_crash.dump"),
        }

    def start(self, timeout_s: float = 90.0) -> RabbitNode:
        assert self.process is None, "the node is already running"
        log = open(self.dir / "server.log", "ab")  # noqa: SIM115 - the server's lifetime
        self.process = subprocess.Popen(
            [RABBITMQ_SERVER], env=self.env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    log_tail = (self.dir / "server.log").read_text()[-2000:]
                    raise RuntimeError(f"rabbitmq-server exited: {log_tail}")
                if _port_open(self.port) and self._accepts_amqp():
                    return self
                time.sleep(0.2)
            raise RuntimeError(f"rabbitmq-server did not open port {self.port} in {timeout_s} s")
        except BaseException:
            # A fixture whose start fails never reaches its finalizer: stop the node here.
            self.close()
            raise

    def _accepts_amqp(self) -> bool:
        import amqp

        try:
            connection = amqp.Connection(f"127.0.0.1:{self.port}", connect_timeout=2)
            connection.connect()
            connection.close()
            return True
        except Exception:
            return False

    def stop(self) -> None:
        if self.process is None:
            return
        # The whole group: rabbitmq-server is a shell script in front of beam and erl_child_setup.
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)
        deadline = time.monotonic() + 30
        while _port_open(self.port) and time.monotonic() < deadline:
            time.sleep(0.1)
        self.process = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def close(self) -> None:
        self.stop()
        kill_processes_with_env("ERL_EPMD_PORT", str(self.epmd_port))  # its epmd, and any stray
        shutil.rmtree(self.dir, ignore_errors=True)
