"""The worker's HTTP endpoints: /metrics (Prometheus text), /healthz (liveness), /readyz (readiness).

A stdlib ThreadingHTTPServer in a daemon thread: a scrape or a probe never waits for an engine
step, and the engine keeps the main thread. The loop only writes a few fields of HealthState
(under a lock); the handlers read them.

- /healthz: 200 while the loop ticks. 503 when the loop has not ticked for `stall_timeout_s` since
  its first tick (a wedged step, a deadlock). Before the first tick (the model is loading) it is
  200: a slow start is for the readiness probe to show, and a liveness failure would restart it.
- /readyz: 200 once the model is loaded and the queue answered (set_ready(True)), and not
  draining; 503 otherwise, with the reason in the body.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

logger = logging.getLogger(__name__)

METRICS_PATH = "/metrics"
LIVENESS_PATH = "/healthz"
READINESS_PATH = "/readyz"
# A CPU step that prefills a 2048-token batch takes seconds on 2 cores; a minute without a tick is
# a loop that is stuck, not a slow one.
DEFAULT_STALL_TIMEOUT_S = 60.0


class HealthState:
    """What the endpoints report, written by the worker loop (thread-safe)."""

    def __init__(self, stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S) -> None:
        if stall_timeout_s <= 0:
            raise ValueError(f"stall_timeout_s must be > 0, got {stall_timeout_s}")
        self.stall_timeout_s = stall_timeout_s
        self._lock = threading.Lock()
        self._last_tick: float | None = None
        self._is_ready = False
        self._is_draining = False
        # Why the broker is unreachable, while it is: not ready until it answers again.
        self._broker_outage: str | None = None

    def tick(self) -> None:
        """The loop is alive: call once per iteration."""
        now = time.monotonic()
        with self._lock:
            self._last_tick = now

    def set_ready(self, is_ready: bool) -> None:
        """True once the model is loaded and the queue answered; False when either is lost."""
        with self._lock:
            self._is_ready = is_ready

    def set_broker_outage(self, reason: str | None) -> None:
        """The broker is unreachable (`reason`), or reachable again (None)."""
        with self._lock:
            self._broker_outage = reason

    def set_draining(self) -> None:
        """A drain began (SIGTERM): not ready from now on, for good."""
        with self._lock:
            self._is_draining = True

    def liveness(self) -> tuple[bool, str]:
        with self._lock:
            last_tick = self._last_tick
        if last_tick is None:
            return True, "starting"
        stalled_s = time.monotonic() - last_tick
        if stalled_s > self.stall_timeout_s:
            return False, f"loop has not ticked for {stalled_s:.1f}s (limit {self.stall_timeout_s:.1f}s)"
        return True, "ok"

    def readiness(self) -> tuple[bool, str]:
        with self._lock:
            is_ready, is_draining = self._is_ready, self._is_draining
            broker_outage = self._broker_outage
        if is_draining:
            return False, "draining"
        if broker_outage is not None:
            return False, f"broker unreachable: {broker_outage}"
        if not is_ready:
            return False, "starting"
        return True, "ok"


class _Handler(BaseHTTPRequestHandler):
    # Set per server class by HealthServer (one subclass per server, so two servers in a process
    # never share them).
    registry: ClassVar[CollectorRegistry]
    state: ClassVar[HealthState]

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == METRICS_PATH:
            self._send(200, generate_latest(self.registry), CONTENT_TYPE_LATEST)
        elif path == LIVENESS_PATH:
            self._send_check(*self.state.liveness())
        elif path == READINESS_PATH:
            self._send_check(*self.state.readiness())
        else:
            self._send(404, b"not found\n", "text/plain; charset=utf-8")

    def _send_check(self, is_ok: bool, reason: str) -> None:
        self._send(200 if is_ok else 503, f"{reason}\n".encode(), "text/plain; charset=utf-8")

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        # Probes arrive every few seconds: per-request lines only at DEBUG.
        logger.debug("%s %s", self.address_string(), format % args)


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        # A probe that gave up before the reply (a busy worker, a short kubelet timeout) is not a
        # server error: without this, every such disconnect prints a BrokenPipe traceback.
        exc = sys.exc_info()[1]
        if isinstance(exc, ConnectionError):
            logger.debug("health client %s disconnected early: %s", client_address, exc)
            return
        super().handle_error(request, client_address)  # type: ignore[arg-type]


class HealthServer:
    """Serves `registry` and `state` on host:port (port 0: any free port; see `.port`)."""

    def __init__(
        self, registry: CollectorRegistry, state: HealthState, *, host: str = "0.0.0.0", port: int = 0
    ) -> None:
        handler = type("HealthHandler", (_Handler,), {"registry": registry, "state": state})
        self._server = _QuietServer((host, port), handler)
        self.host = host
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, name=f"qworker-health-{self.port}", daemon=True
        )

    def start(self) -> HealthServer:
        self._thread.start()
        logger.info(
            "serving %s, %s, %s on %s:%d", METRICS_PATH, LIVENESS_PATH, READINESS_PATH, self.host, self.port
        )
        return self

    def close(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join(timeout=5)
        self._server.server_close()

    def __enter__(self) -> HealthServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
