"""One Client streams many jobs at once: each live stream holds a connection in a blocking read,
and redis-py 8 caps a connection pool at 100 by default, so the 101st stream used to fail with
MaxConnectionsError (seen in the queue benchmark with 128 jobs at once)."""

from __future__ import annotations

import threading

import pytest
import redis as redis_lib

from qworker.jobs.client import Client
from qworker.testing.worker_kit import cleanup, redis_base_url, unique_url

NUM_STREAMS = 130


@pytest.mark.timeout(60)
def test_a_client_streams_more_jobs_at_once_than_redis_pys_default_pool_holds():
    url = unique_url(redis_base_url(), "streams")
    errors: list[BaseException] = []
    timeouts: list[str] = []
    barrier = threading.Barrier(NUM_STREAMS)

    def read(client: Client, job_id: str) -> None:
        barrier.wait()
        try:
            list(client.stream(job_id, timeout=2.0))  # no worker: each read blocks, then times out
        except TimeoutError:
            timeouts.append(job_id)
        except BaseException as exc:
            errors.append(exc)

    try:
        with Client(queue=url, results=url) as client:
            threads = [threading.Thread(target=read, args=(client, f"job{i}")) for i in range(NUM_STREAMS)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(30)
        assert not errors, f"{len(errors)} streams failed, first: {errors[0]!r}"
        assert len(timeouts) == NUM_STREAMS
    finally:
        cleanup(redis_lib.Redis.from_url(url.split("?")[0]), url)
