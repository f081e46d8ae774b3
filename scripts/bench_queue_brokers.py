"""The queue path on RabbitMQ (celery+amqp://) against Redis Streams (redis://), same workload.

    python scripts/bench_queue_brokers.py [--jobs 300] [--rounds 3] [--max-tokens 4]
        [--amqp amqp://guest:guest@127.0.0.1:5672/] [--redis redis://127.0.0.1:6379/0]

One engine (the tiny random Llama of qworker.testing.tiny_model, so that the broker, not the model, is most
of the cost) and one in-process worker on the main thread (run_beside); beside it a client sends
every job through qworker's own producer of that queue and waits for each result in order. The
clock runs from the first send to the last result. Results: Redis Streams in the same Redis;
RabbitMQ's in Celery's Redis result backend on the same Redis (celery+redis://). Rounds
alternate (redis, amqp, amqp, redis, ...) because the machine is shared; every round is printed
and the median jobs/s of each is kept.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from qworker.backends.connections import open_producer, open_sink, open_source
from qworker.backends.source import OutgoingJob
from qworker.config import EngineConfig
from qworker.engine.llm_engine import LLMEngine
from qworker.testing.worker_kit import unique_url, write_tiny_model_dir
from qworker.worker.loop import Worker
from qworker.worker.run_beside import run_beside
from qworker.worker.settings import WorkerSettings


def one_round(
    engine: LLMEngine, queue_url: str, results_url: str, jobs: list[OutgoingJob], max_backlog: int
) -> float:
    worker = Worker(
        engine,
        open_source(queue_url, consumer="bench"),
        open_sink(results_url),
        WorkerSettings(name="bench", max_backlog=max_backlog),
    )
    producer = open_producer(queue_url)
    sink = open_sink(results_url)

    def client() -> float:
        started = time.perf_counter()
        producer.send(jobs)
        for job in jobs:
            while not sink.has_result(job.job_id):
                time.sleep(0.001)
        return time.perf_counter() - started

    try:
        return run_beside(worker, client)
    finally:
        for job in jobs:
            sink.delete_result(job.job_id)
        producer.close()
        sink.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--jobs", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3, help="rounds per broker")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--max-backlog", type=int, default=16)
    parser.add_argument("--amqp", default="amqp://guest:guest@127.0.0.1:5672/")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    args = parser.parse_args()
    model_dir = write_tiny_model_dir(Path(tempfile.mkdtemp(prefix="qwbench-")))
    engine = LLMEngine(
        EngineConfig(model=str(model_dir), dtype="float32", device="cpu", num_kv_blocks=1024, block_size=16)
    )
    redis_db = args.redis.removeprefix("redis://")
    per_broker: dict[str, list[float]] = {"redis-streams": [], "rabbitmq": []}
    order = []
    for i in range(args.rounds):
        order += ["redis-streams", "rabbitmq"] if i % 2 == 0 else ["rabbitmq", "redis-streams"]
    for i, broker in enumerate(["warmup", *order]):
        tag = uuid.uuid4().hex[:8]
        jobs = [
            OutgoingJob(
                f"bench-{tag}-{j}",
                json.dumps(
                    {
                        "prompt_token_ids": [5 + j % 90, 6, 7],
                        "params": {"max_tokens": args.max_tokens, "ignore_eos": True},
                    }
                ).encode(),
            )
            for j in range(args.jobs)
        ]
        if broker in ("warmup", "redis-streams"):
            url = unique_url(args.redis, tag="bench-brokers")
            results = url
        else:
            url = f"celery+{args.amqp.rstrip('/')}/?queue=qwbench-{tag}"
            results = f"celery+redis://{redis_db}"
        seconds = one_round(engine, url, results, jobs, args.max_backlog)
        load = os.getloadavg()[0]
        row = {"round": i, "broker": broker, "seconds": round(seconds, 3), "load_1m": load}
        print(json.dumps({**row, "jobs_per_s": round(len(jobs) / seconds, 1)}), flush=True)
        if broker != "warmup":
            per_broker[broker].append(len(jobs) / seconds)
    summary = {broker: round(statistics.median(values), 1) for broker, values in per_broker.items()}
    pairs = [
        round(a / r, 3) for r, a in zip(per_broker["redis-streams"], per_broker["rabbitmq"], strict=True)
    ]
    print(
        json.dumps(
            {"median_jobs_per_s": summary, "rabbitmq_over_redis_per_pair": pairs, "load_1m": os.getloadavg()}
        )
    )


if __name__ == "__main__":
    main()
