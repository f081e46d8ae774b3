"""Pooling jobs through the worker loop, on the in-memory queue and store and the fake engine (no
model, no Redis): the fan-out into one engine request per input and the fan-in to one result in
input order, the task check, packing (admission by tokens and prompt blocks, inputs sorted by
length) and the job wire itself."""

from __future__ import annotations

import json
from typing import Any

import pytest

from qworker.backends.memory.queue import MemoryQueue, MemorySource
from qworker.backends.memory.results import MemoryResultSink
from qworker.config import EngineConfig
from qworker.engine.pooling_params import PoolingParams
from qworker.jobs.job import JobDecodeError, JobStatus
from qworker.jobs.pooling_job import (
    MAX_POOLING_INPUTS,
    PoolingJob,
    decode_any_job,
    decode_vector,
    encode_vector,
)
from qworker.testing.fake_engine import FakeEngine, fake_pooled_vector
from qworker.worker.admission import AdmissionPolicy, HeldJobSize, PoolingJobSize
from qworker.worker.loop import Worker
from qworker.worker.settings import WorkerSettings

pytestmark = pytest.mark.timeout(30)


def run_jobs(bodies: list[dict[str, Any]], engine: FakeEngine | None = None, **settings: Any):
    queue = MemoryQueue("jobs")
    sink = MemoryResultSink([])
    engine = engine or FakeEngine()
    for body in bodies:
        queue.put(json.dumps(body).encode(), body["id"])
    defaults: dict[str, Any] = dict(
        name="w1", max_backlog=4, poll_interval_s=0.01, cancel_check_interval_s=0.0
    )
    worker = Worker(
        engine, MemorySource(queue, consumer="w1"), sink, WorkerSettings(**{**defaults, **settings})
    )
    worker.run(burst=True)
    return {body["id"]: sink.get_result(body["id"]) for body in bodies}, engine, worker


def vector(tokens: list[int], **params: Any) -> list[float]:
    return fake_pooled_vector(tokens, PoolingParams(**params))


def test_one_job_fans_out_per_input_and_back_in_input_order():
    inputs = ["a much longer input than the others", "b", "mid length"]
    results, engine, _ = run_jobs([{"id": "e1", "task": "embed", "input": inputs}])
    result = results["e1"]
    assert result is not None and result.status is JobStatus.COMPLETED, result
    assert [p.index for p in result.pooled or []] == [0, 1, 2]
    for item, text in zip(result.pooled or [], inputs, strict=True):
        assert item.data == pytest.approx(vector(list(text.encode())), abs=1e-6)
    assert result.usage.prompt_tokens == sum(len(t) for t in inputs)
    # One request per input, named after the job, and handed over shortest first.
    assert sorted(engine.added) == ["e1:0", "e1:1", "e1:2"]
    assert engine.added == ["e1:1", "e1:2", "e1:0"]
    assert not engine.has_unfinished_requests()


def test_token_ids_dimensions_base64_truncation_and_score():
    bodies = [
        {"id": "ids", "task": "embed", "input": [5, 6, 7], "dimensions": 4, "encoding_format": "base64"},
        {"id": "lists", "task": "embed", "input": [[1, 2], [3, 4, 5]], "normalize": False},
        {"id": "cut", "task": "embed", "input": "abcdef", "truncate_prompt_tokens": 2},
        {"id": "cls", "task": "classify", "input": "x"},
        {"id": "score", "task": "score", "query": "q", "documents": ["d1", "doc2"]},
    ]
    results, _, _ = run_jobs(bodies)
    assert all(r is not None and r.status is JobStatus.COMPLETED for r in results.values()), results
    ids = results["ids"].pooled[0]
    assert isinstance(ids.data, str)  # base64 of little-endian float32
    assert decode_vector(ids.data) == pytest.approx(vector([5, 6, 7], dimensions=4), abs=1e-6)
    assert len(decode_vector(ids.data)) == 4
    lists = results["lists"].pooled
    assert lists[1].data == pytest.approx(vector([3, 4, 5], normalize=False), abs=1e-5)
    assert results["cut"].pooled[0].data == pytest.approx(vector(list(b"ef")), abs=1e-6)
    assert results["cut"].usage.prompt_tokens == 2
    assert len(results["cls"].pooled[0].data) == 3
    score = results["score"].pooled
    expected = [vector([*b"q", 0, *doc.encode()], task="score")[0] for doc in ("d1", "doc2")]
    assert all(len(s.data) == 1 for s in score)
    assert [s.data[0] for s in score] == pytest.approx(expected, abs=1e-6)


def test_a_task_the_model_cannot_do_fails_with_the_reason_and_others_run():
    engine = FakeEngine(supported_tasks=("generate",))
    bodies = [
        {"id": "emb", "task": "embed", "input": "hi"},
        {"id": "gen", "prompt": "hello", "params": {"max_tokens": 3}},
    ]
    results, _, _ = run_jobs(bodies, engine)
    assert results["emb"].status is JobStatus.FAILED
    assert results["emb"].error.type == "UnsupportedTaskError"
    assert "cannot embed" in results["emb"].error.message and "generate" in results["emb"].error.message
    assert results["gen"].status is JobStatus.COMPLETED and results["gen"].text == "abc"
    # The reverse: a generation job sent to a pooling-only model.
    results, _, _ = run_jobs(bodies, FakeEngine(supported_tasks=("embed",)))
    assert results["gen"].status is JobStatus.FAILED and results["gen"].error.type == "UnsupportedTaskError"
    assert results["emb"].status is JobStatus.COMPLETED


def test_one_refused_input_fails_its_job_and_frees_its_other_requests():
    engine = FakeEngine(max_model_len=16)
    bodies = [
        {"id": "bad", "task": "embed", "input": ["ok", "x" * 40, "fine"]},
        {"id": "good", "task": "embed", "input": ["ok"]},
    ]
    results, engine, _ = run_jobs(bodies, engine)
    # A too-long input is dead-lettered with its failed result, as a too-long prompt is.
    assert results["bad"].status is JobStatus.FAILED and results["bad"].error.type == "PromptTooLongError"
    assert "16" in results["bad"].error.message
    assert results["good"].status is JobStatus.COMPLETED
    assert not engine.has_unfinished_requests()


def test_packing_takes_pooling_jobs_by_tokens_not_by_backlog():
    engine = FakeEngine(EngineConfig(model="fake", block_size=4, num_kv_blocks=512, max_num_seqs=64))
    bodies = [{"id": f"j{i}", "task": "embed", "input": "t" * (4 + i % 5)} for i in range(40)]
    results, engine, worker = run_jobs(bodies, engine, max_backlog=2)
    assert all(r.status is JobStatus.COMPLETED for r in results.values())
    # With a backlog of 2 a generation worker would hold at most max_num_seqs + 2; the packing
    # worker took the pooling jobs by the token budget (2 x max_num_batched_tokens) instead.
    assert worker.admission.is_packing
    assert worker.stats.num_steps < 40 / 2


def test_admission_counts_prompt_blocks_only_for_pooling_jobs():
    policy = AdmissionPolicy(block_size=4, max_backlog=2, reserve_blocks_per_seq=8, max_jobs_held=10)
    generation = policy.decide(100, 100, [HeldJobSize(8, 64, 1, True)])
    pooling = policy.decide(100, 100, [PoolingJobSize(8, 1)])
    assert generation.num_reserved_blocks == 8 and pooling.num_reserved_blocks == 0
    assert pooling.num_committed_blocks == 3  # ceil(8 / 4) + at most one partial block
    packing = AdmissionPolicy(
        block_size=4, max_backlog=2, reserve_blocks_per_seq=8, max_jobs_held=10, pooling_token_budget=1000
    )
    for _ in range(20):
        packing.observe_pooling(10, 1)
    assert packing.is_packing
    decision = packing.decide(1000, 1000, [PoolingJobSize(500, 50)])
    # (1000 - 500) tokens left at the typical job's ~10, within the blocks: far past the backlog of 2.
    assert 8 < packing.typical_pooling_tokens < 10
    assert decision.num_jobs_to_pull == int(500 // packing.typical_pooling_tokens) > 50
    # Out of KV blocks: nothing, whatever the token budget says.
    assert packing.decide(1000, 10, [PoolingJobSize(500, 50)]).num_jobs_to_pull == 0


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"task": "embed", "input": []}, "input is empty"),
        ({"task": "embed", "input": ""}, "input is empty"),
        ({"task": "embed", "input": ["a", ""]}, "input[1] is empty"),
        ({"task": "embed"}, "embed jobs need input"),
        ({"task": "score", "query": "q"}, "needs query and documents"),
        ({"task": "score", "query": "q", "documents": []}, "documents is empty"),
        ({"task": "classify", "input": "x", "dimensions": 3}, "dimensions is for embed jobs"),
        ({"task": "embed", "input": "x", "use_activation": True}, "use_activation is for classify"),
        ({"task": "embed", "input": "x", "encoding_format": "hex"}, "encoding_format"),
        ({"task": "embed", "input": ["x"] * (MAX_POOLING_INPUTS + 1)}, f"the limit is {MAX_POOLING_INPUTS}"),
        ({"task": "rank", "input": "x"}, "task"),
        ({"task": "embed", "input": "x", "params": {}}, "params: unknown field"),
    ],
)
def test_bad_pooling_jobs_are_refused_naming_the_field(body, message):
    with pytest.raises(JobDecodeError) as caught:
        decode_any_job(json.dumps(body).encode(), "j")
    assert message in caught.value.message


def test_the_wire_tells_the_kinds_apart_and_base64_is_little_endian_float32():
    assert isinstance(decode_any_job(b'{"task": "embed", "input": [1, 2]}', "j"), PoolingJob)
    assert type(decode_any_job(b'{"prompt": "hi"}', "j")).__name__ == "Job"
    assert PoolingJob(task="embed", input=[1, 2]).inputs() == [[1, 2]]
    assert PoolingJob(task="embed", input=[[1], [2, 3]]).inputs() == [[1], [2, 3]]
    # 1.0 as little-endian float32 is 00 00 80 3f.
    assert encode_vector([1.0], "base64") == "AACAPw=="
    assert decode_vector("AACAPw==") == [1.0]


def test_a_failed_step_fails_the_pooling_jobs_whose_requests_it_ran():
    engine = FakeEngine()
    engine.failing_steps = {1: None}  # the first step fails, naming every request it ran
    bodies = [{"id": "e1", "task": "embed", "input": ["a", "b"]}, {"id": "e2", "task": "embed", "input": "c"}]
    results, engine, worker = run_jobs(bodies, engine)
    for job_id in ("e1", "e2"):
        assert results[job_id].status is JobStatus.FAILED, results[job_id]
        assert results[job_id].error.type == "InternalError"
    assert not engine.has_unfinished_requests() and not worker.held


def test_a_celery_task_carries_a_pooling_job_in_its_kwargs():
    from qworker.backends.celery.source import CelerySource

    kwargs = {"task": "score", "query": "q", "documents": ["a", "b"], "priority": 3}
    body, rejection = CelerySource.job_body(json.dumps([[], kwargs, {}]))
    assert rejection is None
    job = decode_any_job(body, "celery-1")
    assert isinstance(job, PoolingJob) and job.documents == ["a", "b"] and job.priority == 3
