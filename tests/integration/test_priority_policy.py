"""A job's priority reaches the engine's priority scheduling, end to end on the real Redis: 5
priority-0 jobs submitted behind 100 priority-9 jobs start within a stated number of engine steps,
ahead of the priority-9 jobs the worker already holds.

With the priority lane (the producer's URL has high_lane_max_priority=0), the priority-0 jobs go
to `{stream}:high`, which the worker reads before the stream: a lane job with `a` lane jobs ahead
of it waits as if the stream were empty, bound(a) below with ahead = a; with none ahead, 2 * T
steps (here 8), however deep the stream is.

Without the lane, the Redis Streams source hands out jobs in stream order, and a worker holds at most
max_num_seqs (S) running plus max_backlog (B) not-started jobs: a job with `ahead` jobs in front
of it is leased only once ahead - (S + B) + 1 of them have completed, and the priority policy can
only reorder the jobs a worker holds. Jobs complete at S per T steps (T: steps one job runs; here a
prompt prefilled in one step plus max_tokens - 1 decodes), so a job waits at most
    T * (ceil((ahead - S - B + 1) / S) + 1)
steps to be leased, then at most T more steps for a running slot (it is first in line for it):
    bound = T * (ceil(max(0, ahead - S - B + 1) / S) + 2).
The bound grows with the job's depth in the stream, as it must without a priority-aware read;
what the policy adds is the overtaking: the priority-0 jobs start before priority-9 jobs that
were leased before them."""

from __future__ import annotations

import math

import pytest
import redis as redis_lib

from qworker.backends.connections import open_sink, open_source
from qworker.config import EngineConfig
from qworker.engine.llm_engine import LLMEngine
from qworker.jobs.client import Client
from qworker.jobs.job import JobStatus
from qworker.testing.worker_kit import cleanup, redis_base_url, unique_url
from qworker.worker.loop import Worker
from qworker.worker.settings import WorkerSettings

NUM_LOW = 100
NUM_HIGH = 5
MAX_NUM_SEQS = 4
MAX_BACKLOG = 8
MAX_TOKENS = 4


class StepCounter:
    """The real engine, counting steps and noting the step in which each request first ran."""

    def __init__(self, engine: LLMEngine) -> None:
        self._engine = engine
        self.num_steps = 0
        self.first_step: dict[str, int] = {}

    def step(self):
        outputs = self._engine.step()
        self.num_steps += 1
        for output in outputs:
            self.first_step.setdefault(output.request_id, self.num_steps)
        return outputs

    def __getattr__(self, name):
        return getattr(self._engine, name)


def run(tiny_model_dir, policy: str, lane: bool = False) -> StepCounter:
    url = unique_url(redis_base_url(), "priority")
    producer_url = f"{url}&high_lane_max_priority=0" if lane else url
    try:
        with Client(queue=producer_url, results=url) as client:
            low = [
                {"id": f"low{i}", "priority": 9, "prompt_token_ids": [5 + i, 6, 7]} for i in range(NUM_LOW)
            ]
            high = [
                {"id": f"high{i}", "priority": 0, "prompt_token_ids": [200 + i, 6, 7]}
                for i in range(NUM_HIGH)
            ]
            for job in low + high:
                job["params"] = {"max_tokens": MAX_TOKENS, "ignore_eos": True}
                client.submit(job)
            engine = StepCounter(
                LLMEngine(
                    EngineConfig(
                        model=str(tiny_model_dir),
                        dtype="float32",
                        device="cpu",
                        num_kv_blocks=256,
                        block_size=16,
                        max_num_seqs=MAX_NUM_SEQS,
                        scheduling_policy=policy,
                    )
                )
            )
            worker = Worker(
                engine,
                open_source(url, consumer="w"),
                open_sink(url),
                WorkerSettings(name="w", max_backlog=MAX_BACKLOG),
            )
            stats = worker.run(burst=True)
            assert stats.num_completed == NUM_LOW + NUM_HIGH
            results = client.results([j["id"] for j in low + high], timeout=10)
            assert all(r.status is JobStatus.COMPLETED for r in results)
        return engine
    finally:
        cleanup(redis_lib.Redis.from_url(url.split("?")[0]), url)


def step_bound(ahead: int) -> int:
    steps_per_job = MAX_TOKENS  # one prefill step (3-token prompt) + MAX_TOKENS - 1 decodes
    waves = math.ceil(max(0, ahead - MAX_NUM_SEQS - MAX_BACKLOG + 1) / MAX_NUM_SEQS)
    return steps_per_job * (waves + 2)


@pytest.mark.timeout(300)
def test_priority_lane_starts_urgent_jobs_within_a_bound_independent_of_the_stream_depth(tiny_model_dir):
    engine = run(tiny_model_dir, "priority", lane=True)
    first_steps = [engine.first_step[f"high{i}"] for i in range(NUM_HIGH)]
    print("first steps of the priority-0 jobs, with the lane", first_steps)
    # Lane job i has i lane jobs ahead of it; the 100 stream jobs do not count.
    assert all(step <= step_bound(i) for i, step in enumerate(first_steps)), first_steps
    assert max(first_steps) <= 2 * MAX_TOKENS, first_steps
    # They start before any priority-9 job that was not already running.
    first_low = sorted(engine.first_step[f"low{j}"] for j in range(NUM_LOW))
    assert max(first_steps) <= first_low[0], (first_steps, first_low[:8])


@pytest.mark.timeout(300)
def test_priority_zero_jobs_behind_a_hundred_start_within_the_bound_and_overtake(tiny_model_dir):
    """Without the lane: a bound that grows with the depth in the stream."""
    engine = run(tiny_model_dir, "priority")
    for i in range(NUM_HIGH):
        ahead = NUM_LOW + i
        assert engine.first_step[f"high{i}"] <= step_bound(ahead), (i, engine.first_step[f"high{i}"])
    # Each priority-0 job starts before priority-9 jobs that the worker held before it.
    overtaken = [
        sum(engine.first_step[f"low{j}"] > engine.first_step[f"high{i}"] for j in range(NUM_LOW))
        for i in range(NUM_HIGH)
    ]
    print("first steps of the priority-0 jobs", [engine.first_step[f"high{i}"] for i in range(NUM_HIGH)])
    print(
        "priority-9 jobs each overtook",
        overtaken,
        "bounds",
        [step_bound(NUM_LOW + i) for i in range(NUM_HIGH)],
    )
    assert overtaken[0] >= MAX_BACKLOG // 2 and all(n >= 1 for n in overtaken), overtaken

    # First come, first served: the same queue starts every priority-9 job first.
    fcfs = run(tiny_model_dir, "fcfs")
    first_high = min(fcfs.first_step[f"high{i}"] for i in range(NUM_HIGH))
    assert all(fcfs.first_step[f"low{i}"] <= first_high for i in range(NUM_LOW))
