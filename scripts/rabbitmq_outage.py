"""A RabbitMQ outage under a working qworker worker (issue 37): the worker's AMQP connection goes
through a loopback TCP proxy in front of the node (qworker/testing/tcp_proxy.py), which is cut
for --cut-s seconds while the worker holds jobs (new connections refused, the live one closed),
then restored. The node itself keeps running, so its queue (and the producer's messages) survive;
this is the outage as the worker sees it. Results go to Celery's Redis result backend, which
stays up.

    python scripts/rabbitmq_outage.py                 # about 40 s; RabbitMQ on 127.0.0.1:5672
    python scripts/rabbitmq_outage.py --jobs 40 --cut-s 30

It prints the figures docs/WORKER.md quotes: how long the cut lasted, how long the worker was
down, and per job its results and engine runs. When the connection closes, RabbitMQ requeues the
deliveries the worker held unacked; the worker takes them again on reconnect, and a job it
already holds (running, or its result waiting in the outbox) joins that job instead of running
twice. Exactly once means: one stored result per job, and the engine completed each job once.

Not in the test suite: against the shared node it is quick, but a private node (as
tests/integration/test_celery_rabbitmq.py starts one) takes longer to start than the suite allows.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qworker.backends.connections import open_sink, open_source
from qworker.config import EngineConfig
from qworker.engine.llm_engine import LLMEngine
from qworker.jobs.client import Client
from qworker.jobs.job import JobStatus
from qworker.testing.tcp_proxy import CuttableProxy
from qworker.testing.worker_kit import write_tiny_model_dir
from qworker.worker.loop import Worker
from qworker.worker.settings import WorkerSettings

RESULTS = "celery+redis://127.0.0.1:6379/12"


def amqp_url(port: int, queue: str) -> str:
    return f"celery+amqp://guest:guest@127.0.0.1:{port}/?queue={queue}"


class OutageLog(logging.Handler):
    """The worker's outage warnings (qworker.worker.retry), with their times."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[tuple[float, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((time.monotonic(), record.getMessage()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=24)
    parser.add_argument("--cut-s", type=float, default=20.0)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--amqp-port", type=int, default=5672)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    outage_log = OutageLog()
    logging.getLogger("qworker.worker.retry").addHandler(outage_log)

    queue = f"qw-outage-{uuid.uuid4().hex[:8]}"
    model_dir = write_tiny_model_dir(Path(tempfile.mkdtemp(prefix="qw-outage-model-")))
    engine = LLMEngine(
        EngineConfig(model=str(model_dir), dtype="float32", device="cpu", num_kv_blocks=512, block_size=16)
    )
    with CuttableProxy(args.amqp_port) as proxy:
        settings = WorkerSettings(name="w", max_attempts=3, broker_outage_s=max(60.0, 3 * args.cut_s))
        worker = Worker(
            engine, open_source(amqp_url(proxy.port, queue), consumer="w"), open_sink(RESULTS), settings
        )
        # The producer and the result reader go to the node directly: only the worker's link is cut.
        client = Client(queue=amqp_url(args.amqp_port, queue), results=RESULTS)
        reader = open_sink(RESULTS)
        ids = [
            client.submit(
                {
                    "id": f"{queue}-{i}",
                    "prompt_token_ids": [5 + i % 50, 6, 7],
                    "params": {"max_tokens": args.max_tokens, "ignore_eos": True},
                }
            )
            for i in range(args.jobs)
        ]
        figures: dict[str, float] = {}

        def outage() -> None:
            try:
                # Cut while the worker holds a full backlog (or all the jobs), or after 10 s.
                deadline = time.monotonic() + 10
                wanted = min(len(ids), settings.max_backlog)
                while worker.num_jobs_held < wanted and time.monotonic() < deadline:
                    time.sleep(0.01)
                figures["held_at_cut"] = worker.num_jobs_held
                figures["cut_at"] = time.monotonic()
                proxy.cut()
                time.sleep(args.cut_s)
                proxy.resume()
                figures["resumed_at"] = time.monotonic()
                while sum(reader.get_result(j) is not None for j in ids) < len(ids):
                    time.sleep(0.5)
                figures["done_at"] = time.monotonic()
            finally:
                worker.stop()

        driver = threading.Thread(target=outage, daemon=True)
        started = time.monotonic()
        driver.start()
        stats = worker.run()
        driver.join(timeout=30)
        results = [reader.get_result(j) for j in ids]
        client.close()
        for j in ids:
            reader.delete_result(j)

    unreachable = [t for t, m in outage_log.records if m.startswith("broker unreachable")]
    back = [(t, m) for t, m in outage_log.records if m.startswith("broker reachable again")]
    completed = [r for r in results if r is not None and r.status == JobStatus.COMPLETED]
    print(f"jobs: {len(ids)}, {args.max_tokens} tokens each; held when cut: {figures['held_at_cut']:.0f}")
    print(f"cut: {figures['resumed_at'] - figures['cut_at']:.1f} s")
    if unreachable and back:
        print(
            f"worker saw the outage {unreachable[0] - figures['cut_at']:.2f} s into the cut; "
            f"reachable again {back[-1][0] - figures['resumed_at']:.2f} s after the link came back "
            f"({back[-1][1]})"
        )
    print(
        f"all results {figures['done_at'] - figures['resumed_at']:.1f} s after; "
        f"run {time.monotonic() - started:.1f} s"
    )
    print(
        f"results stored: {len(completed)} of {len(ids)} completed; "
        f"engine completions: {stats.num_completed}; "
        f"failed {stats.num_failed}, dead-lettered {stats.num_dead_lettered}"
    )
    print(
        "attempts per job (count of jobs):",
        {a: [r.attempts for r in completed].count(a) for a in sorted({r.attempts for r in completed})},
    )
    print("outages the worker rode out:", worker.outage.num_outages)
    print("held jobs dropped (their deliveries requeued by the broker):", stats.num_leases_lost)
    ok = len(completed) == len(ids) == stats.num_completed and stats.num_failed == 0
    print("exactly once:", "yes" if ok else "NO")
    _drop_queue(args.amqp_port, queue)
    if not ok:
        sys.exit(1)


def _drop_queue(port: int, queue: str) -> None:
    import amqp  # type: ignore[import-untyped]

    connection = amqp.Connection(f"127.0.0.1:{port}", userid="guest", password="guest")
    connection.connect()
    try:
        channel = connection.channel()
        for name in (queue, f"{queue}.dead"):
            channel.queue_delete(name)
            channel.exchange_delete(name)
    finally:
        connection.close()


if __name__ == "__main__":
    main()
