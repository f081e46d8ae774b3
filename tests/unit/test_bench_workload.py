"""Workload specs: parsing, deterministic request generation, arrival processes, lengths."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from importlib import resources
from pathlib import Path

import numpy as np
import pytest

from qworker.bench.load import LoadGenerator
from qworker.bench.workload import (
    MIN_RANDOM_TOKEN_ID,
    WorkloadError,
    generate_requests,
    load_workload,
    packaged_workloads,
    parse_workload,
    request_set_digest,
)

pytestmark = pytest.mark.timeout(60)

VOCAB = 49152


def spec_dict(**overrides: object) -> dict:
    data = {
        "name": "t",
        "num_requests": 50,
        "arrival": {"process": "poisson", "rate": 2.0},
        "prompt_len": {"dist": "lognormal", "median": 100, "sigma": 0.9, "min": 4, "max": 300},
        "output_len": {"dist": "uniform", "min": 8, "max": 64},
        "seed": 3,
    }
    data.update(overrides)
    return data


@pytest.mark.parametrize("name", ["offline-mixed", "online-poisson", "shared-prefix"])
def test_packaged_workloads_parse_and_generate(name: str) -> None:
    """The specs ship as package data: a bare name loads them, and so does their file path."""
    assert name in packaged_workloads()
    spec = load_workload(name)
    assert spec.name == name and load_workload(f"{name}.json") == spec
    path = resources.files("qworker.bench") / "workloads" / f"{name}.json"
    raw = json.loads(path.read_text())
    requests = generate_requests(spec, VOCAB)
    assert len(requests) == raw["num_requests"]
    assert requests == generate_requests(load_workload(name), VOCAB)
    for r in requests:
        assert r.output_len >= 1 and r.prompt_len >= 1
        assert r.temperature == raw["temperature"] and r.ignore_eos is raw["ignore_eos"]


def test_a_file_wins_over_a_packaged_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "offline-mixed").write_text(json.dumps(spec_dict(name="mine")))
    monkeypatch.chdir(tmp_path)
    assert load_workload("offline-mixed").name == "mine"
    assert load_workload(tmp_path / "offline-mixed").name == "mine"
    with pytest.raises(WorkloadError, match="packaged workload"):
        load_workload("no-such-workload")


def test_same_spec_same_requests_different_seed_different() -> None:
    spec = parse_workload(spec_dict())
    a, b = generate_requests(spec, VOCAB), generate_requests(spec, VOCAB)
    assert a == b
    assert request_set_digest(a) == request_set_digest(b)
    other = generate_requests(spec.with_overrides(seed=4), VOCAB)
    assert request_set_digest(other) != request_set_digest(a)


def test_digest_is_stable_across_processes() -> None:
    # "Running twice gives the same request set": a fresh interpreter (new hash seed) agrees.
    code = (
        "from qworker.bench.workload import *; import json, sys;"
        "spec = parse_workload(json.loads(sys.argv[1]));"
        "print(request_set_digest(generate_requests(spec, 49152)))"
    )
    digests = {
        subprocess.run(
            [sys.executable, "-c", code, json.dumps(spec_dict())], capture_output=True, text=True, check=True
        ).stdout.strip()
        for _ in range(2)
    }
    here = request_set_digest(generate_requests(parse_workload(spec_dict()), VOCAB))
    assert digests == {here}


def test_rate_override_moves_only_arrivals() -> None:
    spec = parse_workload(spec_dict())
    slow = generate_requests(spec.with_overrides(rate=1.0), VOCAB)
    fast = generate_requests(spec.with_overrides(rate=4.0), VOCAB)
    assert request_set_digest(slow, include_arrivals=False) == request_set_digest(
        fast, include_arrivals=False
    )
    # Same pattern, stretched: arrival times scale with 1 / rate.
    np.testing.assert_allclose([r.arrival_s for r in slow], [4 * r.arrival_s for r in fast])
    everything = generate_requests(spec.with_overrides(rate=math.inf), VOCAB)
    assert all(r.arrival_s == 0.0 for r in everything)


def test_num_requests_override_keeps_a_prefix() -> None:
    spec = parse_workload(spec_dict())
    full = generate_requests(spec, VOCAB)
    head = generate_requests(spec.with_overrides(num_requests=10), VOCAB)
    assert head == full[:10]


def test_poisson_and_gamma_gaps() -> None:
    spec = parse_workload(spec_dict(num_requests=4000, arrival={"process": "poisson", "rate": 5.0}))
    arrivals = np.array([r.arrival_s for r in generate_requests(spec, VOCAB)])
    assert arrivals[0] == 0.0 and np.all(np.diff(arrivals) >= 0)
    gaps = np.diff(arrivals)
    assert gaps.mean() == pytest.approx(0.2, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.07)  # exponential: CV 1
    bursty = parse_workload(
        spec_dict(num_requests=4000, arrival={"process": "gamma", "rate": 5.0, "burstiness": 0.25})
    )
    gaps = np.diff([r.arrival_s for r in generate_requests(bursty, VOCAB)])
    assert gaps.mean() == pytest.approx(0.2, rel=0.1)
    assert gaps.std() / gaps.mean() == pytest.approx(2.0, rel=0.1)  # gamma shape k: CV 1/sqrt(k)


def test_poisson_with_burstiness_is_gamma() -> None:
    spec = parse_workload(spec_dict(arrival={"process": "poisson", "rate": 1.0, "burstiness": 0.5}))
    assert spec.arrival.process == "gamma"


def test_fixed_concurrency_and_all_at_once() -> None:
    spec = parse_workload(spec_dict(arrival={"process": "fixed_concurrency", "concurrency": 4}))
    assert spec.arrival.concurrency_limit == 4
    assert all(r.arrival_s == 0.0 for r in generate_requests(spec, VOCAB))
    capped = parse_workload(spec_dict(arrival={"process": "poisson", "rate": 1.0, "max_concurrency": 2}))
    assert capped.arrival.concurrency_limit == 2
    assert capped.with_overrides(rate=3.0).arrival.concurrency_limit == 2
    assert parse_workload(spec_dict(arrival={"process": "all_at_once"})).arrival.concurrency_limit is None


def test_length_distributions_respect_bounds() -> None:
    spec = parse_workload(spec_dict(num_requests=2000))
    requests = generate_requests(spec, VOCAB)
    prompt = np.array([r.prompt_len for r in requests])
    output = np.array([r.output_len for r in requests])
    assert prompt.min() >= 4 and prompt.max() <= 300
    assert 80 < np.median(prompt) < 120  # lognormal median 100
    assert (prompt == 300).any()  # clipped at max, not redrawn
    assert output.min() >= 8 and output.max() <= 64
    assert set(output) == set(range(8, 65))  # uniform, both ends inclusive
    fixed = parse_workload(spec_dict(prompt_len=12, output_len={"dist": "fixed", "value": 5}))
    assert {(r.prompt_len, r.output_len) for r in generate_requests(fixed, VOCAB)} == {(12, 5)}


def test_random_tokens_avoid_control_and_special_ids() -> None:
    spec = parse_workload(spec_dict(num_requests=200))
    excluded = list(range(40, 1000))
    ids = np.concatenate(
        [r.prompt_token_ids for r in generate_requests(spec, 2000, excluded_token_ids=excluded)]
    )
    assert ids.min() >= MIN_RANDOM_TOKEN_ID and ids.max() < 2000
    assert not np.isin(ids, excluded).any()


def test_shared_prefix() -> None:
    spec = parse_workload(
        spec_dict(shared_prefix_len=64, prompt_len={"dist": "uniform", "min": 16, "max": 96})
    )
    requests = generate_requests(spec, VOCAB)
    prefix = requests[0].prompt_token_ids[:64]
    assert all(r.prompt_token_ids[:64] == prefix for r in requests)
    assert all(16 <= r.prompt_len - 64 <= 96 for r in requests)
    assert len({tuple(r.prompt_token_ids[64:]) for r in requests}) == len(requests)


def test_jsonl_lengths_text_and_ids(tmp_path: Path) -> None:
    rows = [
        {"prompt": "hello world", "n": 5},
        {"prompt": [40, 41, 42], "n": 7},
        {"prompt": 9, "n": 2},
    ]
    (tmp_path / "real.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(
        json.dumps(
            spec_dict(
                num_requests=5,
                arrival={"process": "all_at_once"},
                prompt_len={"dist": "jsonl", "path": "real.jsonl", "field": "prompt"},
                output_len={"dist": "jsonl", "path": "real.jsonl", "field": "n", "max": 6},
            )
        )
    )
    spec = load_workload(spec_file)

    def tokenize(text: str) -> list[int]:
        return [100 + len(word) for word in text.split()]

    requests = generate_requests(spec, VOCAB, tokenize=tokenize)
    assert requests[0].prompt_token_ids == [105, 105]
    assert requests[1].prompt_token_ids == [40, 41, 42]
    assert requests[2].prompt_len == 9  # a length: random tokens
    assert requests[3].prompt_token_ids == [105, 105]  # file rows cycle in order
    assert [r.output_len for r in requests] == [5, 6, 2, 5, 6]  # clipped to max 6
    with pytest.raises(WorkloadError, match="needs a tokenizer"):
        generate_requests(spec, VOCAB)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"arival": {}}, "unknown key"),
        ({"arrival": {"process": "weibull"}}, "arrival.process"),
        ({"arrival": {"process": "poisson"}}, "arrival.rate"),
        ({"arrival": {"process": "fixed_concurrency"}}, "arrival.concurrency"),
        ({"prompt_len": {"dist": "uniform", "min": 4}}, "uniform needs min and max"),
        ({"prompt_len": {"dist": "uniform", "min": 40, "max": 4}}, "min"),
        ({"output_len": {"dist": "lognormal", "median": -1, "sigma": 1}}, "median"),
        ({"output_len": {"dist": "jsonl", "path": "nope.jsonl"}}, "does not exist"),
        ({"num_requests": 0}, "num_requests"),
        ({"temperature": -1}, "temperature"),
    ],
)
def test_bad_specs_say_what_is_wrong(change: dict, message: str) -> None:
    with pytest.raises(WorkloadError, match=message):
        parse_workload(spec_dict(**change), base_dir=Path("/nonexistent"))


def test_missing_workload_file(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError, match="does not exist"):
        load_workload(tmp_path / "x.json")


# -- the load generator ------------------------------------------------------------------------


def requests_at(*arrivals: float):
    spec = parse_workload(spec_dict(num_requests=len(arrivals), arrival={"process": "all_at_once"}))
    base = generate_requests(spec, VOCAB)
    from dataclasses import replace

    return [replace(r, arrival_s=a) for r, a in zip(base, arrivals, strict=True)]


def test_open_loop_sends_at_scheduled_time_even_when_polled_late() -> None:
    load = LoadGenerator(requests_at(0.0, 0.5, 2.0))
    assert [s.send_time for s in load.poll(0.0)] == [0.0]
    assert load.next_send_time() == 0.5
    # The driver was busy until t=1.7: the request still arrived at 0.5 and waited.
    assert [s.send_time for s in load.poll(1.7)] == [0.5]
    assert load.poll(1.9) == []
    assert [s.send_time for s in load.poll(5.0)] == [2.0]
    assert load.is_exhausted and load.next_send_time() is None


def test_concurrency_cap_sends_when_a_slot_frees() -> None:
    load = LoadGenerator(requests_at(0.0, 0.0, 0.0, 0.0), max_concurrency=2)
    assert len(load.poll(0.0)) == 2
    assert load.next_send_time() is None  # waiting on a finish
    assert load.poll(1.0) == []
    load.on_finished(1.5)
    assert load.next_send_time() == 1.5
    sent = load.poll(2.0)
    assert [s.send_time for s in sent] == [1.5]  # sent when the slot freed, not when polled
    assert load.num_outstanding == 2 and load.num_pending == 1
    assert [r.request_id for r in load.drain()] == [requests_at(0, 0, 0, 0)[3].request_id]
