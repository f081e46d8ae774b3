"""The gateway's Prometheus metrics (on their own registry, served at /metrics), and the ASGI
middleware that counts requests by route and status and times the first byte of each response."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# From a cached 404 to a long prompt waiting for a worker that starts from zero.
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    120,
    300,
    600,
)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "qworker_gateway_requests",
            "HTTP requests answered, by route and status",
            ["route", "status"],
            registry=r,
        )
        self.inflight_requests = Gauge(
            "qworker_gateway_inflight_requests", "Generation requests this replica is serving", registry=r
        )
        self.inflight_streams = Gauge(
            "qworker_gateway_inflight_streams", "Server-sent event streams open now", registry=r
        )
        self.time_to_first_byte = Histogram(
            "qworker_gateway_time_to_first_byte_seconds",
            "From the request's arrival to the first byte of its response, by route",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.enqueue_to_first_token = Histogram(
            "qworker_gateway_enqueue_to_first_token_seconds",
            "From the job's enqueue to its first streamed token (or, unstreamed, its result)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.rejected = Counter(
            "qworker_gateway_rejected_requests",
            "Requests refused with 429, by reason",
            ["reason"],
            registry=r,
        )
        self.cancelled_jobs = Counter(
            "qworker_gateway_cancelled_jobs",
            "Jobs cancelled because their client went away or their wait limit passed, by reason",
            ["reason"],
            registry=r,
        )


def route_label(scope: Scope) -> str:
    """The matched route's template (/v1/models), never the raw path: a client cannot grow the
    label set by sending random paths."""
    route = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else "unmatched"


class MetricsMiddleware:
    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status: list[int] = []

        async def timed_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            elif message["type"] == "http.response.body" and len(status) == 1:
                status.append(0)  # first body part: timed once
                self.metrics.time_to_first_byte.labels(route_label(scope)).observe(
                    time.perf_counter() - started
                )
            await send(message)

        try:
            await self.app(scope, receive, timed_send)
        finally:
            code = str(status[0]) if status else "disconnected"
            self.metrics.requests.labels(route_label(scope), code).inc()
