"""The outbox across a failover: a result stored, then its ack failing because the broker went
away, and the broker that comes back (a promoted replica) never received the result. The retry
must write the result again before it acks, and count it once; without the failover it writes
nothing twice.
"""

from __future__ import annotations

import pytest
import redis

from qworker.backends.memory.queue import MemoryQueue, MemorySource
from qworker.backends.memory.results import MemoryResultSink
from qworker.jobs.job import JobResult, JobStatus
from qworker.worker.outbox import Outbox, PendingFinal

pytestmark = pytest.mark.timeout(30)


class FailingOnce(MemorySource):
    """Its first ack raises (the primary died); `on_failure` runs just before."""

    def __init__(self, queue: MemoryQueue, on_failure) -> None:  # type: ignore[no-untyped-def]
        super().__init__(queue, consumer="w1")
        self.on_failure = on_failure
        self.num_acks_tried = 0

    def ack(self, lease) -> None:  # type: ignore[no-untyped-def]
        self.num_acks_tried += 1
        if self.num_acks_tried == 1:
            self.on_failure()
            raise redis.ConnectionError("Connection refused")
        super().ack(lease)


def one_final(queue: MemoryQueue, source: MemorySource) -> tuple[Outbox, JobResult]:
    queue.put(b"{}", "job-1")
    [lease] = source.lease(1, 0.0)
    result = JobResult(id="job-1", status=JobStatus.COMPLETED, text="hello")
    outbox = Outbox()
    outbox.add_final(PendingFinal(result=result, leases=[lease]))
    return outbox, result


@pytest.mark.parametrize("fails_over", [True, False], ids=["failover", "same-broker"])
def test_a_result_whose_ack_failed_is_there_before_the_ack(fails_over: bool) -> None:
    queue, sink = MemoryQueue("outbox"), MemoryResultSink()
    reported: list[tuple[str, bool]] = []
    source = FailingOnce(queue, on_failure=lambda: sink.results.clear() if fails_over else None)
    outbox, result = one_final(queue, source)
    with pytest.raises(redis.ConnectionError):
        outbox.flush(sink, source, lambda r, is_new: reported.append((r.id, is_new)))
    assert not outbox.is_empty and queue.depth() == 1
    outbox.flush(sink, source, lambda r, is_new: reported.append((r.id, is_new)))
    assert outbox.is_empty and queue.depth() == 0
    assert sink.get_result("job-1") == result
    assert reported == [("job-1", True)], "counted once"
