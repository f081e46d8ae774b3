"""Helpers of the dashboard's tests: fake-engine worker processes (dashboard_worker.py) on the
suite's Redis, a gateway with a read and an admin key, a dead letter made by the real source."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qworker.testing.worker_kit import kill_group

ADMIN_KEY = "sk-dash-admin-" + uuid.uuid4().hex[:8]
READ_KEY = "sk-dash-read-" + uuid.uuid4().hex[:8]
WORKER_SCRIPT = Path(__file__).with_name("dashboard_worker.py")


@dataclass
class FakeWorker:
    name: str
    process: subprocess.Popen
    metrics_port: int
    log_path: Path

    def kill(self) -> None:
        """SIGKILL: no drain, no last report."""
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                kill_group(self.process)


def spawn_fake_worker(url: str, name: str, interval_s: float, metrics_port: int, log_dir: Path) -> FakeWorker:
    log_path = log_dir / f"{name}.log"
    log = open(log_path, "w")  # noqa: SIM115 - the process owns it
    process = subprocess.Popen(
        [sys.executable, str(WORKER_SCRIPT), url, name, str(interval_s), str(metrics_port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"},
        start_new_session=True,
    )
    deadline = time.monotonic() + 60
    while f"worker {name} ready" not in log_path.read_text():
        if process.poll() is not None or time.monotonic() > deadline:
            kill_group(process)
            raise RuntimeError(f"fake worker {name} did not start:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.05)
    return FakeWorker(name, process, metrics_port, log_path)


@dataclass
class Pool:
    url: str
    workers: dict[str, FakeWorker] = field(default_factory=dict)

    def stop(self) -> None:
        for worker in self.workers.values():
            worker.stop()


def stream_of(url: str) -> str:
    from urllib.parse import parse_qs, urlsplit

    return parse_qs(urlsplit(url).query)["stream"][0]


def make_dead_letter(url: str, job: dict[str, Any], reason: str) -> str:
    """A dead letter of the queue at `url` holding `job`, written by the real Redis source: the
    job goes on a side stream whose dead-letter stream is the queue's, is leased there and
    dead-lettered with `reason`. Replay puts it on the queue itself. Returns the letter's id."""
    from qworker.backends.connections import open_source
    from qworker.jobs.client import Client

    stream = stream_of(url)
    side = f"{stream}:side{uuid.uuid4().hex[:6]}"
    side_url = url.replace(f"stream={stream}", f"stream={side}") + f"&dead_letter={stream}:dead"
    with Client(queue=side_url) as client:
        client.submit(job)
    source = open_source(side_url, consumer="dlq-maker", lease_timeout_s=30)
    try:
        leases = source.lease(1, 1.0)
        assert len(leases) == 1, "the side stream's job was not leased"
        source.dead_letter(leases[0], reason)
    finally:
        source.close()
    import redis

    r = redis.Redis.from_url(url.split("?")[0])
    entries = r.xrevrange(f"{stream}:dead", count=1)
    r.delete(side)
    return entries[0][0].decode()
