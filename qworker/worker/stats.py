"""A worker's counters, as it publishes them (write_worker_stats: JSON of this dataclass)."""

from __future__ import annotations

from dataclasses import dataclass

from qworker.jobs.job import JobStatus
from qworker.startup import HardwareInfo, StartupTimings
from qworker.worker.admission import AdmissionStats

# The counter each stored result's status adds one to.
RESULT_COUNTERS: dict[JobStatus, str] = {
    JobStatus.COMPLETED: "num_completed",
    JobStatus.FAILED: "num_failed",
    JobStatus.TIMEOUT: "num_timeout",
    JobStatus.CANCELLED: "num_cancelled",
}


@dataclass
class WorkerStats:
    admission: AdmissionStats | None = None
    num_completed: int = 0
    num_failed: int = 0
    num_timeout: int = 0
    num_cancelled: int = 0
    num_dead_lettered: int = 0
    num_released: int = 0
    # Redelivered jobs that already had a result: acked without running.
    num_skipped_done: int = 0
    num_leases_lost: int = 0
    num_steps: int = 0
    # Broker outages ridden out, and text deltas dropped because one lasted too long.
    num_broker_outages: int = 0
    num_deltas_dropped: int = 0
    # Set once at start (qworker/startup.py): the device and KV pool, and the time to ready.
    hardware: HardwareInfo | None = None
    startup: StartupTimings | None = None
    # What the dashboard shows (issue 42), set at each write by report.py: when this report was
    # written and how often one is, who wrote it, its requests and its output rate.
    reported_at: float | None = None
    report_interval_s: float | None = None
    host: str | None = None
    pid: int | None = None
    started_at: float | None = None
    model: str | None = None
    quantization: str | None = None
    adapters: list[str] | None = None
    # LoRA adapters loaded since start: read from their files into host memory (each a miss of
    # max_cpu_loras), and copied into one of max_loras device slots.
    num_adapter_loads: int = 0
    num_adapter_slot_loads: int = 0
    num_running: int | None = None
    num_waiting: int | None = None
    num_generated_tokens: int = 0
    # Output tokens per second over the last minute (report.RATE_WINDOW_S).
    output_tokens_per_s: float | None = None

    def count_result(self, status: JobStatus) -> None:
        counter = RESULT_COUNTERS[status]
        setattr(self, counter, getattr(self, counter) + 1)
