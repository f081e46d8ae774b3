"""Worker settings (the engine's live in qworker.config.EngineConfig)."""

from __future__ import annotations

import logging
import os
import socket
import uuid
from dataclasses import dataclass, field

# Set to 1 to log job payloads (prompts, message bodies, result text) at DEBUG. Off by default:
# prompts are user data, and DEBUG logs often end up in shared log stores.
LOG_PAYLOADS_ENV = "QWORKER_LOG_PAYLOADS"

# Libraries that log request and response bodies (so: prompts) at DEBUG.
PAYLOAD_LOGGERS = ("botocore", "boto3", "s3transfer", "urllib3", "kombu", "celery", "amqp", "redis")


def log_payloads_from_env() -> bool:
    return os.environ.get(LOG_PAYLOADS_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def quiet_payload_loggers(log_payloads: bool) -> None:
    """Unless payload logging is on, keep the libraries that dump message bodies at DEBUG (botocore
    logs every SQS message it sends or receives) at INFO, whatever the root level."""
    if log_payloads:
        return
    for name in PAYLOAD_LOGGERS:
        lib = logging.getLogger(name)
        if lib.level == logging.NOTSET or lib.level < logging.INFO:
            lib.setLevel(logging.INFO)


def default_worker_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass
class WorkerSettings:
    # Also the consumer name in the queue: unique per process.
    name: str = field(default_factory=default_worker_name)
    # Jobs held but not yet started by the engine (see admission.py).
    max_backlog: int = 8
    # KV blocks kept free for each running job's growth.
    reserve_blocks_per_seq: int = 1
    # Deliveries allowed before a job is dead-lettered (a job that kills its worker every time
    # must not kill every worker in the pool).
    max_attempts: int = 3
    # How long an idle worker blocks on the queue before it looks around again.
    poll_interval_s: float = 0.5
    # None: a third of the source's lease timeout.
    lease_extend_interval_s: float | None = None
    cancel_check_interval_s: float = 0.25
    stats_interval_s: float = 1.0
    # SIGTERM: finish what can finish within this, release the rest at once.
    drain_grace_s: float = 30.0
    # Log job payloads (prompt, result text, decode errors that quote the input) at DEBUG.
    log_payloads: bool = field(default_factory=log_payloads_from_env)

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.drain_grace_s < 0:
            raise ValueError(f"drain_grace_s must be >= 0, got {self.drain_grace_s}")
