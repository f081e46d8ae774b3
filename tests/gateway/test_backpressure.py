"""The backpressure rule (qworker/gateway/backpressure.py), as numbers in and decisions out: a
reader stands in for the queue's demand reading (the real one is checked against Redis in
test_openai_sdk.py)."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest

from qworker.gateway.backpressure import DemandGate
from qworker.gateway.errors import GatewayError
from qworker.pool.demand import PoolDemand, Work


@dataclass
class Reading:
    waiting_blocks: int

    def read(self) -> PoolDemand:
        return PoolDemand(
            waiting=Work(1, self.waiting_blocks), running=Work(), capacity_blocks=None, desired_workers=1
        )

    def close(self) -> None:
        pass


def gate(waiting_blocks: int, bound: int | None = 100, max_inflight: int = 10) -> DemandGate:
    g = DemandGate(
        reader=Reading(waiting_blocks) if bound is not None else None,
        max_waiting_blocks=bound,
        interval_s=60,
        retry_after_s=3,
        max_inflight_requests=max_inflight,
    )
    g.start()
    assert g.wait_first_reading(5)
    return g


@pytest.mark.timeout(10)
def test_refuses_past_the_bound_in_blocks_with_retry_after():
    g = gate(waiting_blocks=90)
    g.admit(10).release()  # 90 + 10 = 100: at the bound, admitted
    with pytest.raises(GatewayError) as refused:
        g.admit(11)
    assert refused.value.status_code == 429 and refused.value.headers == {"Retry-After": "3"}
    assert refused.value.code == "queue_saturated"
    g.close()


@pytest.mark.timeout(10)
def test_what_this_replica_enqueued_since_the_reading_counts():
    g = gate(waiting_blocks=50)
    g.admit(30).release()
    with pytest.raises(GatewayError):
        g.admit(30)  # 50 read + 30 sent since > 100 - 30
    g.close()


@pytest.mark.timeout(10)
def test_a_request_alone_past_the_bound_passes_when_nothing_waits():
    g = gate(waiting_blocks=0)
    g.admit(5000).release()
    g.close()


@pytest.mark.timeout(10)
def test_in_flight_requests_are_bounded_without_a_kv_bound():
    g = gate(waiting_blocks=0, bound=None, max_inflight=2)
    first, second = g.admit(1), g.admit(1)
    with pytest.raises(GatewayError) as refused:
        g.admit(1)
    assert refused.value.code == "too_many_requests"
    first.release()
    first.release()  # idempotent
    g.admit(1).release()
    second.release()
    assert g.num_inflight == 0
    g.close()


@pytest.mark.timeout(10)
def test_a_failing_reading_keeps_the_last_one():
    third_read = threading.Event()

    class Flaky(Reading):
        calls = 0

        def read(self) -> PoolDemand:
            Flaky.calls += 1
            if Flaky.calls >= 3:
                # The second read failed and the loop went on to this one: that failure is handled.
                third_read.set()
            if Flaky.calls > 1:
                raise ConnectionError("redis is away")
            return super().read()

    g = DemandGate(
        reader=Flaky(95), max_waiting_blocks=100, interval_s=0.01, retry_after_s=1, max_inflight_requests=5
    )
    g.start()
    assert g.wait_first_reading(5)
    assert third_read.wait(5), "the reading thread goes on after a failed read"
    assert g.waiting_blocks == 95
    with pytest.raises(GatewayError):
        g.admit(10)
    g.close()
