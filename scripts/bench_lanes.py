"""What affinity lanes cost a worker's read: one non-blocking lease over the priority lane, the
stream and L lanes, on a private redis-server on loopback (never a server it did not start).

For each lane count it times `RedisStreamSource.lease(count, 0)` (the script read, and the
reclaim when due) with the queue empty (the idle poll, which also looks at every lane it might
steal from) and with jobs waiting on the worker's own lanes, and reports the median and p99 in
microseconds, and the ratio against one lane measured in the same run.

    .venv/bin/python scripts/bench_lanes.py --lanes 1,8,64,256 --calls 2000
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from qworker.backends.redis.producer import open_producer
from qworker.backends.redis.server import RedisServer
from qworker.backends.redis.streams import open_source
from qworker.backends.source import OutgoingJob

BODY = json.dumps({"prompt": "hello", "params": {"max_tokens": 4}}).encode()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def time_leases(url: str, num_calls: int, *, with_jobs: bool) -> list[float]:
    producer = open_producer(url, None)
    source = open_source(url, "bench-worker", 30.0)
    others = [open_source(url, f"peer-{i}", 30.0) for i in range(3)]
    for peer in others:
        peer.lease(0, 0.0)
    source._last_heartbeat = float("-inf")
    source.lease(0, 0.0)
    samples = []
    for i in range(num_calls):
        if with_jobs:
            producer.send([OutgoingJob(f"j{i}-{k}", BODY, affinity=f"key-{i}-{k}") for k in range(4)])
        started = time.perf_counter()
        leases = source.lease(8, 0.0)
        samples.append((time.perf_counter() - started) * 1e6)
        for lease in leases:
            source.ack(lease)
    # Leave nothing behind for the next lane count.
    for stream in source.streams.all:
        source.redis.delete(stream)
    for closing in (source, *others):
        closing.close()
    producer.close()
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lanes", default="1,8,64,256")
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp)).start()
        try:
            rows = []
            for num_lanes in (int(x) for x in args.lanes.split(",")):
                for with_jobs in (False, True):
                    url = f"{server.url}?stream=bench:{num_lanes}:{int(with_jobs)}&affinity_lanes={num_lanes}"
                    samples = time_leases(url, args.calls, with_jobs=with_jobs)
                    rows.append((num_lanes, with_jobs, statistics.median(samples), percentile(samples, 0.99)))
        finally:
            server.stop()
    base = {with_jobs: median for lanes, with_jobs, median, _ in rows if lanes == 1}
    print(f"{'lanes':>6} {'queue':>8} {'median us':>10} {'p99 us':>8} {'x 1 lane':>9}")
    for lanes, with_jobs, median, p99 in rows:
        print(
            f"{lanes:>6} {'jobs' if with_jobs else 'empty':>8} {median:>10.0f} {p99:>8.0f} "
            f"{median / base[with_jobs]:>9.2f}"
        )


if __name__ == "__main__":
    main()
