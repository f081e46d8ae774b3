"""Every value that passes validation runs. Hostile sampling parameters on a tiny random Llama with
the SmolLM2 tokenizer (so that stop strings and special tokens are decoded for real): a property
test over SamplingParams in a batch with other requests, and regression tests for the values that
used to crash a step, through LLM.generate and through the worker loop.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from qworker.backends.memory.queue import MemoryQueue, MemorySource
from qworker.backends.memory.results import MemoryResultSink
from qworker.engine.llm import LLM
from qworker.engine.sampling_params import MAX_SEED, MIN_SEED, SamplingParams
from qworker.errors import InvalidParamsError, InvalidRequestError
from qworker.jobs.job import JobError, JobResult, JobStatus
from qworker.testing.worker_kit import write_tiny_model_dir
from qworker.worker.loop import Worker
from qworker.worker.settings import WorkerSettings

VOCAB_SIZE = 49152  # the tiny model's (write_tiny_model_dir), the SmolLM2 tokenizer's
MAX_MODEL_LEN = 48


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    model_dir = write_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"))
    return LLM(
        model=str(model_dir),
        dtype="float32",
        device="cpu",
        block_size=4,
        num_kv_blocks=128,
        max_num_seqs=8,
        max_model_len=MAX_MODEL_LEN,
    )


def assert_engine_empty(llm: LLM) -> None:
    engine = llm.llm_engine
    kv = engine.kv_stats()
    assert not engine.has_unfinished_requests()
    assert kv.num_free_blocks == kv.num_total_blocks, kv


PROMPT = {"prompt_token_ids": [1, 520, 3000, 17, 9]}
# Batch companions of the hostile request: a greedy one and a seeded one.
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=6, temperature=0.8, top_k=40, seed=7, ignore_eos=True)


# -- the property ------------------------------------------------------------------------------

huge_ints = st.sampled_from([2**31, 2**63 - 1, 2**63, 2**64, 10**30, 10**400])
token_ids = st.integers(0, VOCAB_SIZE - 1) | st.sampled_from([0, 2, VOCAB_SIZE - 1])
# Values that pass, at their edges.
valid_values = {
    "max_tokens": st.integers(1, 80) | st.just(1_000_000),
    "min_tokens": st.integers(0, 8),
    "temperature": st.sampled_from([0.0, 5e-324, 1e-300, 1e-3, 0.01, 1.0, 1e308, 10**30])
    | st.floats(0.0, 10.0),
    "top_p": st.sampled_from([5e-324, 1e-300, 0.5, 1.0]) | st.floats(5e-324, 1.0),
    "top_k": st.integers(-1, VOCAB_SIZE + 5) | huge_ints,
    "min_p": st.sampled_from([0.0, 5e-324, 1.0]) | st.floats(0.0, 1.0),
    "seed": st.none() | st.integers(MIN_SEED, MAX_SEED) | st.sampled_from([MIN_SEED, -1, 0, MAX_SEED]),
    "stop": st.lists(st.text(min_size=1, max_size=4), max_size=3),
    "stop_token_ids": st.lists(token_ids, max_size=4),
    "ignore_eos": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "skip_special_tokens": st.booleans(),
}
bad_floats = st.sampled_from([float("nan"), float("inf"), -float("inf"), -1.0, -5e-324, 10**400])
# Values that must be refused, by SamplingParams or (token ids) when the request enters the engine.
bad_values = {
    "max_tokens": st.sampled_from([0, -1, 1_000_001, 10**30]),
    "min_tokens": st.sampled_from([-1, 1_000_001, 10**30]),
    "temperature": bad_floats,
    "top_p": bad_floats | st.just(0.0) | st.just(1.5),
    "top_k": st.sampled_from([-2, -(10**30)]),
    "min_p": bad_floats | st.just(1.5),
    "seed": st.sampled_from([MIN_SEED - 1, MAX_SEED + 1, 2**64, 10**30, -(10**30)]),
    "stop": st.just([""]),
    "stop_token_ids": st.lists(
        st.sampled_from([VOCAB_SIZE, 999999, 2**63, 10**30, -1]), min_size=1, max_size=2
    ),
}


@st.composite
def params_kwargs(draw: st.DrawFn) -> dict:
    """SamplingParams keywords: half of them all valid, the others with one bad value."""
    kwargs = draw(st.fixed_dictionaries({}, optional=valid_values))
    if draw(st.booleans()):
        name = draw(st.sampled_from(sorted(bad_values)))
        kwargs[name] = draw(bad_values[name])
        # Where a bad value would hurt if it got through: stop ids are banned while below
        # min_tokens, a seed is used by sampled requests only.
        if name == "stop_token_ids":
            kwargs.update(max_tokens=4, min_tokens=2)
        if name == "seed":
            kwargs["temperature"] = 1.0
    return kwargs


@pytest.mark.timeout(240)
@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(kwargs=params_kwargs())
# The values that used to crash a step, whatever the draws.
@example(kwargs={"max_tokens": 4, "min_tokens": 2, "stop_token_ids": [999999]})
@example(kwargs={"temperature": 1, "top_k": 10**30})
@example(kwargs={"temperature": 1, "seed": 10**30})
def test_any_accepted_params_run_in_a_batch(llm, kwargs):
    try:
        params = SamplingParams(**kwargs)
    except InvalidParamsError:
        return  # rejected up front: nothing to run
    try:
        outputs = llm.generate([PROMPT, PROMPT, PROMPT], [params, GREEDY, SEEDED])
    except InvalidRequestError as exc:
        # Only the checks that need the model may reject it now, and then nothing ran.
        assert "vocabulary" in str(exc), exc
        assert_engine_empty(llm)
        return
    hostile, greedy, seeded = outputs
    completion = hostile.outputs[0]
    assert completion.finish_reason in ("stop", "length")
    assert 1 <= len(completion.token_ids) <= min(params.max_tokens, MAX_MODEL_LEN - 5)
    assert all(0 <= t < VOCAB_SIZE for t in completion.token_ids)
    assert len(greedy.outputs[0].token_ids) == len(seeded.outputs[0].token_ids) == 6
    assert_engine_empty(llm)


# -- the values that used to crash a step ------------------------------------------------------


def test_stop_token_ids_outside_the_vocabulary_are_rejected_before_anything_runs(llm):
    bad = SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[999999])
    num_steps = llm.llm_engine.num_steps
    with pytest.raises(InvalidParamsError, match=r"stop_token_ids \[999999\] is outside the vocabulary"):
        llm.generate([PROMPT, PROMPT], [GREEDY, bad])
    # The good request of the same call did not run and did not stay behind.
    assert_engine_empty(llm)
    assert llm.llm_engine.num_steps == num_steps, "the rejected call ran no step"
    # Nothing pending: a step now schedules nothing, so it runs no model step either.
    assert llm.llm_engine.step() == [] and llm.llm_engine.num_steps == num_steps
    [out] = llm.generate(
        [PROMPT], SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[VOCAB_SIZE - 1])
    )
    assert len(out.outputs[0].token_ids) >= 2


def test_top_k_above_the_vocabulary_cuts_nothing(llm):
    huge = SamplingParams(max_tokens=8, temperature=1.0, top_k=10**30, seed=3, ignore_eos=True)
    off = SamplingParams(max_tokens=8, temperature=1.0, top_k=0, seed=3, ignore_eos=True)
    [a, b] = llm.generate([PROMPT, PROMPT], [huge, off])
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert_engine_empty(llm)


def test_seeds_are_64_bit(llm):
    with pytest.raises(InvalidParamsError, match=r"seed must be an integer in \[-2\*\*63, 2\*\*63 - 1\]"):
        SamplingParams(seed=10**30)
    with pytest.raises(InvalidParamsError):
        SamplingParams(seed=MAX_SEED + 1)
    edges = [SamplingParams(max_tokens=3, temperature=1.0, seed=s) for s in (MIN_SEED, -1, MAX_SEED)]
    outputs = llm.generate([PROMPT] * 3, edges)
    assert all(len(out.outputs[0].token_ids) >= 1 for out in outputs)
    assert_engine_empty(llm)


@pytest.mark.parametrize("name", ["temperature", "top_p", "min_p"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), 10**400, True, "1"])
def test_non_finite_or_non_numbers_are_refused(name, value):
    with pytest.raises(InvalidParamsError, match=name):
        SamplingParams(**{name: value})


def test_tiny_temperatures_sample_like_greedy(llm):
    # Raised to 0.01 (as vLLM does): dividing by less overflows float32 logits to inf and NaN.
    tiny = SamplingParams(max_tokens=6, temperature=1e-300, seed=1, ignore_eos=True)
    assert tiny.temperature == 0.01
    [a, b] = llm.generate([PROMPT, PROMPT], [tiny, GREEDY])
    assert a.outputs[0].token_ids == b.outputs[0].token_ids


@pytest.mark.timeout(120)
def test_the_same_values_through_the_worker_loop(llm):
    queue = MemoryQueue("hostile")
    sink = MemoryResultSink()
    worker = Worker(
        llm.llm_engine,
        MemorySource(queue, consumer="w"),
        sink,
        WorkerSettings(name="w", poll_interval_s=0.01, cancel_check_interval_s=0.0),
    )
    prompt = PROMPT["prompt_token_ids"]
    jobs = {
        "stop-ids": {"min_tokens": 2, "stop_token_ids": [999999]},
        "top-k": {"temperature": 1, "top_k": 10**30},
        "seed": {"seed": 10**30},
        "good": {"temperature": 0},
    }
    for job_id, params in jobs.items():
        body = {"prompt_token_ids": prompt, "params": {"max_tokens": 4, **params}}
        queue.put(json.dumps(body).encode(), job_id)
    stats = worker.run(burst=True)

    def result(job_id: str) -> JobResult:
        res = sink.get_result(job_id)
        assert res is not None, job_id
        return res

    assert (result("stop-ids").error.type, result("stop-ids").status) == (
        "InvalidParamsError",
        JobStatus.FAILED,
    )
    assert "outside the vocabulary" in result("stop-ids").error.message
    assert result("top-k").status is JobStatus.COMPLETED
    assert len(result("top-k").token_ids) == 4
    assert result("seed").error.type == "ValidationError"
    assert "seed must be an integer in [-2**63, 2**63 - 1]" in result("seed").error.message
    assert result("good").status is JobStatus.COMPLETED
    assert (stats.num_completed, stats.num_failed, queue.depth()) == (2, 2, 0)
    assert_engine_empty(llm)


def test_a_failed_result_quoting_any_input_can_be_stored():
    # JSON's \ud800 escape parses to a lone surrogate, which UTF-8 (so Redis, S3, logs) cannot hold.
    error = JobError(type="ValidationError", message="prompt \ud800 is bad")
    stored = JobResult(id="x", status=JobStatus.FAILED, error=error).model_dump_json()
    assert JobResult.model_validate_json(stored).error.message == "prompt \\ud800 is bad"
