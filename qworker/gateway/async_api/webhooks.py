"""Webhooks of async jobs: when a job with a `webhook` ends, its final status object is POSTed
there, signed as Standard Webhooks specifies (the `standardwebhooks` package verifies it):

    webhook-id: the job id + "." + the attempt number's base (one id per event, the same on retries)
    webhook-timestamp: seconds since the epoch
    webhook-signature: "v1," + base64(HMAC-SHA256(secret, f"{id}.{timestamp}.{body}"))

The secret is `whsec_` + base64 in the file `--webhook-secret-file`. A delivery that fails (an
error status, a timeout, a refused address) is retried with capped exponential backoff
(`--webhook-backoff-s` doubling up to `--webhook-max-backoff-s`), at most
`--webhook-max-attempts` times; then the job's record says `webhook_status: failed` with the last
error. The job's result is never touched. Attempts, the next attempt's time and the status live in
the job's record (records.py), and each delivery holds a lease, so replicas share the work and a
killed one loses nothing.

Every delivery resolves the host again, checks the address against the allow-list
(webhook_targets.py) and connects to that address, so DNS rebinding cannot reach inside.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from qworker.errors import QworkerError
from qworker.gateway.async_api.leases import Leases
from qworker.gateway.async_api.records import Records
from qworker.gateway.async_api.webhook_targets import WebhookPolicy, WebhookTargetError, parse_target
from qworker.gateway.settings import GatewaySettings

logger = logging.getLogger(__name__)

WEBHOOK_KIND = "webhook"
JOB_KIND = "job"
SECRET_PREFIX = "whsec_"
SCAN_INTERVAL_S = 0.2
DELIVERY_THREADS = 8


class WebhookSecretError(QworkerError, ValueError):
    """A webhook secret file that cannot be used."""


def load_secret(path: str) -> bytes:
    try:
        text = Path(path).read_text().strip()
    except OSError as exc:
        raise WebhookSecretError(f"cannot read the webhook secret file {path}: {exc}") from None
    try:
        secret = base64.b64decode(text.removeprefix(SECRET_PREFIX), validate=True)
    except ValueError:
        raise WebhookSecretError(f"the webhook secret in {path} is not whsec_ + base64") from None
    if len(secret) < 16:
        raise WebhookSecretError(f"the webhook secret in {path} is shorter than 16 bytes")
    return secret


def sign(secret: bytes, message_id: str, timestamp: int, body: bytes) -> str:
    signed = f"{message_id}.{timestamp}.".encode() + body
    digest = hmac.new(secret, signed, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def backoff_s(settings: GatewaySettings, num_failed: int) -> float:
    """Wait after the `num_failed`-th failure: backoff, doubled each time, capped."""
    return min(settings.webhook_max_backoff_s, settings.webhook_backoff_s * 2 ** (num_failed - 1))


def deliver(
    policy: WebhookPolicy, secret: bytes, url: str, message_id: str, body: bytes, timeout_s: float
) -> None:
    """One POST; raises on anything but a 2xx. Connects to an address checked at this moment."""
    target = parse_target(url)
    address = policy.resolve(target)[0]
    host = f"[{address}]" if address.version == 6 else str(address)
    timestamp = int(time.time())
    headers = {
        "content-type": "application/json",
        "host": target.host if target.port in (80, 443) else f"{target.host}:{target.port}",
        "user-agent": "qworker-gateway-webhooks",
        "webhook-id": message_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": sign(secret, message_id, timestamp, body),
    }
    with httpx.Client(timeout=timeout_s, follow_redirects=False, trust_env=False) as http:
        reply = http.post(
            f"{target.scheme}://{host}:{target.port}{target.path}",
            content=body,
            headers=headers,
            extensions={"sni_hostname": target.host},
        )
    if not 200 <= reply.status_code < 300:
        raise RuntimeError(f"the receiver answered {reply.status_code}")


class WebhookDispatcher:
    """Delivers the webhooks of ended jobs. `final_status(job_id)` is the job's status object, or
    None while it has not ended."""

    def __init__(
        self,
        settings: GatewaySettings,
        records: Records,
        leases: Leases,
        secret: bytes,
        final_status: Callable[[str], dict[str, Any] | None],
        has_ended: Callable[[str], bool],
    ) -> None:
        self.settings = settings
        self.records = records
        self.leases = leases
        self.secret = secret
        self.policy = WebhookPolicy(settings.webhook_allow)
        self.final_status = final_status
        self.has_ended = has_ended
        self._closing = threading.Event()
        self._pool = ThreadPoolExecutor(DELIVERY_THREADS, thread_name_prefix="webhook")
        self._in_flight: set[str] = set()
        self._lock = threading.Lock()
        self._scanner: threading.Thread | None = None

    def start(self) -> None:
        self._scanner = threading.Thread(target=self._scan_loop, name="webhook-scanner", daemon=True)
        self._scanner.start()

    def close(self) -> None:
        self._closing.set()
        if self._scanner is not None:
            self._scanner.join(timeout=5)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _scan_loop(self) -> None:
        while not self._closing.wait(SCAN_INTERVAL_S):
            try:
                for job_id in self.records.active_ids(WEBHOOK_KIND):
                    with self._lock:
                        if job_id in self._in_flight:
                            continue
                    record = self.records.get(JOB_KIND, job_id)
                    if record is None:
                        self.records.deactivate(WEBHOOK_KIND, job_id)
                        continue
                    if time.time() < record.get("webhook_next_at", 0) or not self.has_ended(job_id):
                        continue
                    if not self.leases.take(WEBHOOK_KIND, job_id):
                        continue
                    with self._lock:
                        self._in_flight.add(job_id)
                    self._pool.submit(self._attempt, job_id)
            except Exception:
                logger.exception("scanning webhooks failed; retrying")

    def _attempt(self, job_id: str) -> None:
        try:
            status = self.final_status(job_id)
            record = self.records.get(JOB_KIND, job_id)
            if status is None or record is None:
                return
            body = json.dumps(status).encode()
            num_attempts = record.get("webhook_attempts", 0) + 1
            record["webhook_attempts"] = num_attempts
            try:
                deliver(
                    self.policy,
                    self.secret,
                    record["webhook"],
                    f"msg_{job_id}",
                    body,
                    self.settings.webhook_timeout_s,
                )
            except (httpx.HTTPError, RuntimeError, WebhookTargetError) as exc:
                error = str(exc) if not isinstance(exc, httpx.TimeoutException) else "timed out"
                record["webhook_error"] = f"attempt {num_attempts}: {type(exc).__name__}: {error}"[:500]
                if num_attempts >= self.settings.webhook_max_attempts:
                    record["webhook_status"] = "failed"
                    self.records.put(JOB_KIND, job_id, record)
                    self.records.deactivate(WEBHOOK_KIND, job_id)
                    logger.warning(
                        "job %s: webhook failed %d times, given up: %s", job_id, num_attempts, error
                    )
                    return
                record["webhook_status"] = "retrying"
                record["webhook_next_at"] = time.time() + backoff_s(self.settings, num_attempts)
                self.records.put(JOB_KIND, job_id, record)
                return
            record["webhook_status"] = "delivered"
            record["webhook_error"] = None
            self.records.put(JOB_KIND, job_id, record)
            self.records.deactivate(WEBHOOK_KIND, job_id)
        except Exception:
            logger.exception("job %s: webhook attempt failed unexpectedly", job_id)
        finally:
            with self._lock:
                self._in_flight.discard(job_id)
            self.leases.release(WEBHOOK_KIND, job_id)
