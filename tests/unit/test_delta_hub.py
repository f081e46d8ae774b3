"""The gateway's asyncio reader of delta streams (backends/redis/delta_hub.py, issue 43 item 6) on
the suite's real Redis: what each reader yields equals what the blocking reader
(RedisResultSink.read_deltas) yields, for hundreds of readers on a few connections and no thread;
backlogs with superseded attempts, a result without a done marker, a timeout; and TextFollower,
the attempt logic Client.stream and the gateway share."""

from __future__ import annotations

import asyncio
import threading

import pytest
import redis

from qworker.backends.connections import open_sink
from qworker.backends.redis import delta_hub, keys
from qworker.backends.redis.delta_hub import open_delta_hub
from qworker.backends.sink import Delta, ResumePoint
from qworker.errors import StreamRestartedError
from qworker.jobs.job import JobResult, JobStatus
from qworker.jobs.text_follower import TextFollower
from qworker.testing.worker_kit import cleanup, redis_base_url, unique_url


@pytest.fixture
def sink():
    url = unique_url(redis_base_url(), "hub")
    store = open_sink(url)
    yield store
    store.close()
    cleanup(redis.Redis.from_url(redis_base_url()), url)


async def collect(hub, job_id: str, timeout_s: float = 30.0) -> list[Delta]:
    return [d async for d in hub.read_deltas(job_id, timeout_s)]


def test_many_readers_on_few_connections_and_no_thread(sink, monkeypatch):
    # Small readers, so that 300 streams need many of them and joins wake blocked XREADs.
    monkeypatch.setattr(delta_hub, "KEYS_PER_READER", 16)
    num_jobs, num_tokens = 300, 12

    async def run() -> tuple[dict[str, str], set[threading.Thread], int]:
        hub = open_delta_hub(sink)
        assert hub is not None
        # Threads by identity: other tests' background threads may end meanwhile.
        threads_before = set(threading.enumerate())
        readers = {f"job-{j}": asyncio.create_task(collect(hub, f"job-{j}")) for j in range(num_jobs)}
        await asyncio.sleep(0.05)
        new_threads = set(threading.enumerate()) - threads_before
        loop = asyncio.get_running_loop()

        def write() -> None:  # a worker's steps: one pipeline of deltas per step, then results
            for t in range(num_tokens):
                sink.write_deltas([Delta(j, f"{j}:{t} ", [t], pos=t) for j in readers])
            for j in readers:
                sink.write_result(JobResult(id=j, status=JobStatus.COMPLETED, text="x"))

        await loop.run_in_executor(None, write)
        texts = {j: "".join(d.text for d in await task) for j, task in readers.items()}
        num_readers = len(hub.readers)
        await hub.aclose()
        return texts, new_threads, num_readers

    texts, new_threads, num_readers = asyncio.run(run())
    wrong = {j: text for j, text in texts.items() if text != "".join(f"{j}:{t} " for t in range(num_tokens))}
    assert not wrong, (len(wrong), list(wrong.items())[:3])
    assert not new_threads, f"the hub started threads: {new_threads}"
    assert 1 < num_readers <= delta_hub.MAX_READERS  # 300 keys over at most 16 connections


def test_backlog_attempts_result_without_done_marker_and_timeout(sink):
    # A backlog of two attempts: the reader starts at the latest one, as the blocking reader does.
    sink.write_deltas(
        [Delta("a", "old ", [1], pos=0), Delta("a", "", [], attempt=2), Delta("a", "new", [2], pos=0)]
    )
    sink.end_deltas("a", "completed")
    # A stream with no done marker whose result is stored (a trimmed stream): the reader ends.
    sink.write_deltas([Delta("b", "half", [1], pos=0)])
    stored = JobResult(id="b", status=JobStatus.COMPLETED, text="half")
    sink.redis.set(keys.result_key(sink.prefix, sink.layout.job("b")), stored.model_dump_json())

    async def run() -> tuple[list[Delta], list[Delta], BaseException | None]:
        hub = open_delta_hub(sink)
        assert hub is not None
        a, b = await collect(hub, "a"), await collect(hub, "b")
        try:
            await collect(hub, "nothing-comes", timeout_s=0.3)
            error = None
        except TimeoutError as exc:
            error = exc
        await hub.aclose()
        return a, b, error

    a, b, error = asyncio.run(run())
    assert [d.attempt for d in a] == [2, None] and a[1].text == "new"
    assert [d.text for d in a] == [d.text for d in sink.read_deltas("a", 5)]
    assert [d.text for d in b] == ["half"]
    assert isinstance(error, TimeoutError)


def test_open_delta_hub_only_for_one_redis_server(sink):
    assert open_delta_hub(sink) is not None
    assert open_delta_hub(object()) is None


def test_text_follower_drops_a_rerun_it_has_seen_and_refuses_a_divergent_one():
    follower = TextFollower("j")
    assert [follower.feed(Delta("j", t)) for t in ("ab", "c")] == ["ab", "c"]
    assert follower.feed(Delta("j", "", attempt=2)) == ""
    assert [follower.feed(Delta("j", t)) for t in ("a", "bc", "de")] == ["", "", "de"]
    follower.finish()
    resumed = TextFollower("j")
    resumed.feed(Delta("j", "abc"))
    resumed.feed(Delta("j", "", attempt=2, resume=ResumePoint(num_tokens=1, num_chars=2)))
    assert resumed.feed(Delta("j", "cX")) == "X"
    diverged = TextFollower("j")
    diverged.feed(Delta("j", "abc"))
    diverged.feed(Delta("j", "", attempt=3))
    with pytest.raises(StreamRestartedError):
        diverged.feed(Delta("j", "abd"))
    shorter = TextFollower("j")
    shorter.feed(Delta("j", "abc"))
    shorter.feed(Delta("j", "", attempt=2))
    shorter.feed(Delta("j", "ab"))
    with pytest.raises(StreamRestartedError):
        shorter.finish()
