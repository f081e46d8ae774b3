"""Worker settings (the engine's live in qworker.config.EngineConfig)."""

from __future__ import annotations

import logging
import os
import socket
import uuid
from dataclasses import dataclass, field

from qworker import envs

# Set to 1 to log job payloads (prompts, message bodies, result text) at DEBUG. Off by default:
# prompts are user data, and DEBUG logs often end up in shared log stores.
LOG_PAYLOADS_ENV = envs.QWORKER_LOG_PAYLOADS.name

# Libraries that log request and response bodies (so: prompts) at DEBUG.
PAYLOAD_LOGGERS = ("botocore", "boto3", "s3transfer", "urllib3", "kombu", "celery", "amqp", "redis")


def log_payloads_from_env() -> bool:
    return envs.QWORKER_LOG_PAYLOADS.get()


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
    """Worker settings. Every field is also a `qworker worker` option (qworker/cli_options.py): the
    help text here is the option's help, the default here its default."""

    # Also the consumer name in the queue, hence unique per process.
    name: str = field(
        default_factory=default_worker_name,
        metadata={"help": "Worker (consumer) name, unique per process (default: HOST-PID-RANDOM)"},
    )
    # Admission (admission.py) takes these two from here; it has no defaults of its own.
    max_backlog: int = field(
        default=8, metadata={"help": "Jobs held but not yet started by the engine (see docs/WORKER.md)"}
    )
    reserve_blocks_per_seq: int = field(
        default=1, metadata={"help": "KV blocks kept free for each running job's growth"}
    )
    # A job that kills its worker every time must not kill every worker in the pool.
    max_attempts: int = field(default=3, metadata={"help": "Deliveries before a job is dead-lettered"})
    # One failed step fails the jobs in it; failures in a row mean the engine itself is broken.
    max_step_failures: int = field(
        default=3,
        metadata={
            "help": "Engine steps failing in a row before the worker hands its jobs back and exits "
            "(code 4); one failure fails only the jobs in that step"
        },
    )
    poll_interval_s: float = field(
        default=0.5, metadata={"help": "How long an idle worker blocks on the queue before it looks around"}
    )
    lease_extend_interval_s: float | None = field(
        default=None,
        metadata={"help": "Seconds between lease extensions of held jobs (none: a third of the lease)"},
    )
    cancel_check_interval_s: float = field(
        default=0.25, metadata={"help": "Seconds between checks for cancelled jobs"}
    )
    stats_interval_s: float = field(
        default=1.0, metadata={"help": "Seconds between writes of the worker's stats to the results store"}
    )
    drain_grace_s: float = field(
        default=30.0, metadata={"help": "SIGTERM: finish what can finish within this, release the rest"}
    )
    # Long enough for a Redis restart or failover; short enough that an orchestrator restarts a
    # worker whose broker is gone for good.
    broker_outage_s: float = field(
        default=180.0,
        metadata={
            "help": "Seconds the worker rides out an unreachable queue or results store (retrying "
            "with backoff) before it exits (code 5)"
        },
    )
    lora_modules: str | None = field(
        default=None,
        metadata={
            "help": "LoRA adapters jobs may name, as name=path,name=path (a local directory or an "
            "s3:// prefix each; the engine needs --enable-lora; docs/lora.md)"
        },
    )
    lora_dir: str | None = field(
        default=None,
        metadata={
            "help": "A directory or s3:// prefix of LoRA adapters, one per subdirectory, found by "
            "name when a job first names one (docs/lora.md)"
        },
    )
    # Off by default: a port is something an operator chooses (and opens) on purpose.
    metrics_port: int | None = field(
        default=None,
        metadata={"help": "Serve /metrics (Prometheus), /healthz and /readyz on this port (none: off)"},
    )
    # Prompts are user data, and DEBUG logs often end up in shared log stores.
    log_payloads: bool = field(
        default_factory=log_payloads_from_env,
        metadata={
            "help": f"Log prompts, message bodies and result text at DEBUG "
            f"(default: off, or on when {LOG_PAYLOADS_ENV}=1)"
        },
    )

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.max_step_failures < 1:
            raise ValueError(f"max_step_failures must be >= 1, got {self.max_step_failures}")
        if self.broker_outage_s <= 0:
            raise ValueError(f"broker_outage_s must be > 0, got {self.broker_outage_s}")
        if self.drain_grace_s < 0:
            raise ValueError(f"drain_grace_s must be >= 0, got {self.drain_grace_s}")
        from qworker.lora.modules import parse_lora_modules

        unplaced = [name for name, path in parse_lora_modules(self.lora_modules).items() if not path]
        if unplaced:
            raise ValueError(f"lora_modules: a worker needs name=path, got no path for {', '.join(unplaced)}")
