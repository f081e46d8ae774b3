"""What the resume checkpoint costs Redis (docs/queues.md "Resume from tokens").

The checkpoint is the delta stream the worker writes anyway: one XADD per job and engine step.
Resume adds one field to each entry (`pos`, the first token's place in the output) and, when a
redelivered job is taken, one XRANGE of its stream (`read_progress`). This measures, on a private
redis-server it starts on a free loopback port (never 127.0.0.1:6379):

- memory per entry (MEMORY USAGE of a job's stream, one token per entry) with and without `pos`;
- the worker's write: `RedisResultSink.write_deltas` of one step's deltas for `--num-jobs` jobs,
  with and without `pos` (same pipeline, same round trip);
- the resume read: `read_progress` of a stream of 1,000 and 10,000 entries (XRANGE, parse,
  progress_of).

    .venv/bin/python scripts/bench_resume_checkpoint.py [--num-jobs 32] [--num-steps 300]
"""

from __future__ import annotations

import argparse
import statistics
import time

import redis

from qworker.backends.redis.results import RedisResultSink
from qworker.backends.sink import Delta
from qworker.testing.worker_kit import start_private_redis

# A typical SmolLM2 token's text: about four characters.
TOKEN_TEXT = " the"


def write_steps(
    sink: RedisResultSink, num_jobs: int, num_steps: int, *, with_pos: bool, tag: str
) -> list[float]:
    """Seconds per step's write_deltas, one token per job and step."""
    times = []
    for step in range(num_steps):
        deltas = [
            Delta(f"{tag}-{j}", TOKEN_TEXT, [1000 + step % 30000], pos=step if with_pos else None)
            for j in range(num_jobs)
        ]
        started = time.perf_counter()
        sink.write_deltas(deltas)
        times.append(time.perf_counter() - started)
    return times


def bytes_per_entry(r: redis.Redis, sink: RedisResultSink, num_entries: int, *, with_pos: bool) -> float:
    job_id = f"mem-{with_pos}"
    for start in range(0, num_entries, 500):
        sink.write_deltas(
            [
                Delta(job_id, TOKEN_TEXT, [1000 + i], pos=i if with_pos else None)
                for i in range(start, min(num_entries, start + 500))
            ]
        )
    return int(r.memory_usage(sink.delta_key(job_id), samples=0)) / num_entries


def read_ms(sink: RedisResultSink, num_entries: int, repeats: int = 5) -> float:
    job_id = f"read-{num_entries}"
    for start in range(0, num_entries, 500):
        sink.write_deltas(
            [
                Delta(job_id, TOKEN_TEXT, [1000 + i], pos=i)
                for i in range(start, min(num_entries, start + 500))
            ]
        )
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        progress = sink.read_progress(job_id)
        times.append(time.perf_counter() - started)
        assert len(progress.token_ids) == num_entries and progress.problem is None
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-jobs", type=int, default=32)
    parser.add_argument("--num-steps", type=int, default=300)
    args = parser.parse_args()
    server = start_private_redis()
    r = redis.Redis.from_url(server.url)
    sink = RedisResultSink(redis.Redis.from_url(server.url), prefix="bench", delta_maxlen=20_000)
    try:
        print(f"redis-server {r.info('server')['redis_version']} on {server.url}")
        for with_pos in (False, True):
            print(
                f"memory, pos={with_pos}: {bytes_per_entry(r, sink, 2000, with_pos=with_pos):.1f} bytes/entry"
            )
        # Alternate the two kinds, so that drift on a shared machine hits both alike.
        medians: dict[bool, list[float]] = {False: [], True: []}
        for round_index in range(4):
            for with_pos in (False, True) if round_index % 2 == 0 else (True, False):
                times = write_steps(
                    sink, args.num_jobs, args.num_steps, with_pos=with_pos, tag=f"w{round_index}{with_pos}"
                )
                medians[with_pos].append(statistics.median(times))
        without, with_ = (1e6 * statistics.median(medians[k]) for k in (False, True))
        print(
            f"write_deltas of one step, {args.num_jobs} jobs: {without:.0f} us without pos, "
            f"{with_:.0f} us with ({with_ / without:.2f}x; {with_ / args.num_jobs:.1f} us a delta)"
        )
        for num_entries in (1000, 10_000):
            print(f"read_progress of {num_entries} entries: {read_ms(sink, num_entries):.1f} ms")
    finally:
        sink.close()
        r.close()
        server.stop()


if __name__ == "__main__":
    main()
