"""n > 1: several completions of one prompt as child requests sharing its KV blocks, each with its
own seed stream, aggregated into one RequestOutput; step outputs carry the parent id only."""

from __future__ import annotations

import random

import pytest

from qworker.engine.sampling_params import SamplingParams
from qworker.errors import InvalidParamsError
from tests.conftest import run_to_completion, tiny_engine

pytestmark = pytest.mark.timeout(120)

BLOCK = 4
PROMPT = [random.Random(3).randrange(3, 256) for _ in range(22)]


def sample_n(engine, n: int = 4, seed: int | None = 11, **params):
    sp = SamplingParams(n=n, max_tokens=8, temperature=1.0, seed=seed, ignore_eos=True, **params)
    engine.add_request("p", {"prompt_token_ids": PROMPT}, sp)
    return run_to_completion(engine)["p"]


def test_n_seeded_is_reproducible_and_gives_different_samples(tiny_llama) -> None:
    first = sample_n(tiny_engine(tiny_llama, enable_prefix_caching=True))
    again = sample_n(tiny_engine(tiny_llama, enable_prefix_caching=True))
    assert [o.index for o in first.outputs] == [0, 1, 2, 3]
    texts = [o.token_ids for o in first.outputs]
    assert texts == [o.token_ids for o in again.outputs]
    assert len({tuple(t) for t in texts}) > 1
    assert all(len(t) == 8 for t in texts)
    # Completion 0 samples with the request's own seed: it equals the n=1 request.
    single = sample_n(tiny_engine(tiny_llama, enable_prefix_caching=True), n=1)
    assert single.outputs[0].token_ids == texts[0]
    # The same without the prefix cache (children queued at once).
    uncached = sample_n(tiny_engine(tiny_llama, enable_prefix_caching=False))
    assert [o.token_ids for o in uncached.outputs] == texts


def test_prompt_full_blocks_are_computed_once(tiny_llama) -> None:
    engine = tiny_engine(tiny_llama, enable_prefix_caching=True, block_size=BLOCK)
    engine.add_request(
        "p", {"prompt_token_ids": PROMPT}, SamplingParams(n=4, max_tokens=8, seed=5, ignore_eos=True)
    )
    tables: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        engine.step()
        for i in range(4):
            block_ids = engine.kv_cache_manager.block_ids(f"p#{i}")
            if block_ids:
                tables.setdefault(f"p#{i}", list(block_ids))
    full = (len(PROMPT) - 1) // BLOCK
    assert len(tables) == 4
    shared = {tuple(table[:full]) for table in tables.values()}
    assert len(shared) == 1, f"every child starts with the same {full} blocks: {tables}"
    stats = engine.kv_stats()
    assert stats.num_prefix_cache_hits == 3 * full * BLOCK
    assert engine.scheduler.num_prompt_tokens_computed == len(PROMPT) + 3 * (len(PROMPT) - full * BLOCK)
    assert stats.num_used_blocks == 0


def test_greedy_n_gives_n_copies_of_the_greedy_output(tiny_llama) -> None:
    engine = tiny_engine(tiny_llama, enable_prefix_caching=True)
    sp = SamplingParams(n=3, max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    engine.add_request("g", {"prompt_token_ids": PROMPT}, sp)
    out = run_to_completion(engine)["g"]
    reference = tiny_engine(tiny_llama)
    reference.add_request(
        "g",
        {"prompt_token_ids": PROMPT},
        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=1),
    )
    expected = run_to_completion(reference)["g"]
    assert [o.token_ids for o in out.outputs] == [expected.outputs[0].token_ids] * 3
    assert all(o.logprobs is not None and len(o.logprobs) == 6 for o in out.outputs)
    assert out.prompt_logprobs == expected.prompt_logprobs


def test_step_outputs_name_the_parent_and_finish_once(tiny_llama) -> None:
    engine = tiny_engine(tiny_llama, enable_prefix_caching=True)
    engine.add_request(
        "p", {"prompt_token_ids": PROMPT}, SamplingParams(n=3, max_tokens=5, seed=1, ignore_eos=True)
    )
    seen = []
    while engine.has_unfinished_requests():
        seen.extend(engine.step())
    assert {o.request_id for o in seen} == {"p"}
    finished = [o for o in seen if o.finished]
    assert len(finished) == 1 and len(finished[0].output.outputs) == 3
    streamed = [t for o in seen for t in o.new_token_ids]
    assert streamed == finished[0].output.outputs[0].token_ids


def test_abort_stops_every_completion(tiny_llama) -> None:
    engine = tiny_engine(tiny_llama, enable_prefix_caching=True)
    engine.add_request("p", {"prompt_token_ids": PROMPT}, SamplingParams(n=4, max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    partial = engine.abort("p")
    assert partial is not None and not engine.has_unfinished_requests()
    assert engine.kv_stats().num_used_blocks == 0
    assert engine.abort("p") is None
    # The id is free again.
    engine.add_request("p", {"prompt_token_ids": PROMPT}, SamplingParams(n=2, max_tokens=2))
    assert len(run_to_completion(engine)["p"].outputs) == 2


def test_child_seeds_differ_and_stay_in_64_bits() -> None:
    params = SamplingParams(n=4, seed=-(2**63))
    seeds = [params.child_seed(i) for i in range(4)]
    assert seeds[0] == params.seed and len(set(seeds)) == 4
    assert all(-(2**63) <= s < 2**63 for s in seeds)
    assert SamplingParams(n=4).child_seed(2) is None


@pytest.mark.parametrize("bad", [0, -1, 129, 2.0, True])
def test_n_bounds(bad) -> None:
    with pytest.raises(InvalidParamsError):
        SamplingParams(n=bad)


@pytest.mark.timeout(60)
def test_n_and_logprobs_through_a_worker_on_redis(tiny_llama) -> None:
    """A job with n, logprobs and prompt_logprobs through Client, a worker and the real Redis:
    the result lists every completion and their logprobs as the engine gives them offline."""
    import redis as redis_lib

    from qworker.backends.connections import SINK_PARAMS, SOURCE_PARAMS, open_sink, open_source, parse_url
    from qworker.jobs.client import Client
    from qworker.jobs.job import JobResult, JobStatus, logprobs_dict
    from qworker.testing.worker_kit import cleanup, redis_base_url, unique_url
    from qworker.worker.loop import Worker
    from qworker.worker.settings import WorkerSettings

    url = unique_url(redis_base_url(), tag="n-logprobs")
    params = {"n": 3, "max_tokens": 5, "temperature": 1.0, "seed": 9, "ignore_eos": True}
    params |= {"logprobs": 2, "prompt_logprobs": 1}
    try:
        client = Client(queue=url)
        job_id = client.submit({"prompt_token_ids": PROMPT, "params": params})
        engine = tiny_engine(tiny_llama, enable_prefix_caching=True)
        Worker(engine, open_source(url, consumer="n"), open_sink(url), WorkerSettings(name="n")).run(
            burst=True
        )
        result = client.result(job_id, timeout=10)
    finally:
        cleanup(redis_lib.Redis.from_url(parse_url(url, SOURCE_PARAMS | SINK_PARAMS).connection_url), url)
    assert result.status is JobStatus.COMPLETED, result.error
    # What a reader of the stored JSON gets.
    result = JobResult.model_validate_json(result.model_dump_json())
    offline = tiny_engine(tiny_llama, enable_prefix_caching=True)
    offline.add_request("x", {"prompt_token_ids": PROMPT}, SamplingParams(**params))
    expected = run_to_completion(offline)["x"]
    assert result.outputs is not None and [o.index for o in result.outputs] == [0, 1, 2]
    assert [o.token_ids for o in result.outputs] == [c.token_ids for c in expected.outputs]
    assert result.token_ids == expected.outputs[0].token_ids
    assert result.usage.completion_tokens == 15
    for got, want in zip(result.outputs, expected.outputs, strict=True):
        assert got.logprobs is not None and [logprobs_dict(p) for p in got.logprobs] == want.logprobs
        assert all(len(p.top_logprobs) == 2 for p in got.logprobs)
    assert result.logprobs == result.outputs[0].logprobs
    assert result.prompt_token_ids == PROMPT
    assert result.prompt_logprobs is not None and result.prompt_logprobs[0] is None
    assert [logprobs_dict(p) for p in result.prompt_logprobs[1:]] == expected.prompt_logprobs[1:]


def test_later_completions_keep_the_first_ones_place_in_the_queue(tiny_llama) -> None:
    """One sequence at a time: completion 1 of p is queued after p's prefill, yet runs before q,
    which arrived after p."""
    engine = tiny_engine(tiny_llama, enable_prefix_caching=True, max_num_seqs=1)
    engine.add_request("p", {"prompt_token_ids": PROMPT}, SamplingParams(n=2, max_tokens=3, ignore_eos=True))
    engine.add_request("q", {"prompt_token_ids": PROMPT[:5]}, SamplingParams(max_tokens=3, ignore_eos=True))
    order = []
    while engine.has_unfinished_requests():
        order.extend(o.request_id for o in engine.step() if o.finished)
    assert order == ["p", "q"]
