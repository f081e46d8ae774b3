"""Fuzzing a worker through its Redis stream, as a hostile producer would: entries written straight
in the stream's wire format (fields `id` and `job`), with random field names and values, bytes
that are not UTF-8, empty and huge fields, JSON with random types and extreme numbers in every
parameter, interleaved with good jobs. Hypothesis draws the entries; a `qworker worker --burst`
subprocess serves them; `check_outcomes` says whether every entry ended with exactly one outcome.

Used by tests/integration/test_poison_entries.py (a fixed seed) and scripts/fuzz_stream.py (longer
runs, any seed).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from qworker.backends.connections import SINK_PARAMS, SOURCE_PARAMS, parse_url
from qworker.backends.redis import keys as constants
from qworker.jobs.job import JobResult, JobStatus, resolve_job_id

VOCAB_SIZE = 49152  # the tiny model's (qworker.testing.worker_kit.write_tiny_model_dir)
# The worker runs with this context, so that a job asking for a million tokens stays short.
MAX_MODEL_LEN = 96
WORKER_ARGS = ("--max-model-len", str(MAX_MODEL_LEN), "--block-size", "16", "--num-kv-blocks", "1024")


@dataclass
class Entry:
    """One stream entry to write, and what it must end as."""

    fields: dict[bytes, bytes]
    # A good job: must complete with exactly this many tokens (ignore_eos, short).
    num_tokens: int | None = None
    kind: str = "fuzz"


@dataclass
class Outcomes:
    num_entries: int = 0
    num_results: int = 0
    num_dead_lettered: int = 0
    num_completed: int = 0
    num_good_completed: int = 0
    error_types: Counter = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)


# -- what to write -----------------------------------------------------------------------------

INVALID_UTF8 = [b"\xff\xfe", b"\xc3\x28", b"\xa0\xa1", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"\x80"]
HUGE = 3 * 2**20

extreme_ints = st.sampled_from(
    [
        0,
        -1,
        1,
        2,
        2**31 - 1,
        2**31,
        2**53 + 1,
        2**63 - 1,
        2**63,
        -(2**63),
        -(2**63) - 1,
        2**64,
        10**30,
        -(10**30),
    ]
)
extreme_floats = st.sampled_from([0.0, -0.0, 5e-324, 1e-300, 0.5, 1.0, 1.5, 1e308, -1e308]) | st.floats(
    allow_nan=True, allow_infinity=True
)
scalars = (
    st.none()
    | st.booleans()
    | extreme_ints
    | st.integers()
    | extreme_floats
    | st.text(max_size=12)
    | st.sampled_from(["\ud800", "\x00", "ÿ", ""])
)
json_values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
PARAM_NAMES = [
    "max_tokens",
    "min_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "include_stop_str_in_output",
    "skip_special_tokens",
]
JOB_NAMES = [
    "id",
    "prompt",
    "messages",
    "prompt_token_ids",
    "params",
    "priority",
    "timeout_s",
    "ttl_s",
    "metadata",
]
param_values = (
    extreme_ints
    | extreme_floats
    | json_values
    | st.lists(extreme_ints | st.integers(0, VOCAB_SIZE + 5), max_size=4)
    | st.lists(st.text(max_size=4), max_size=3)
)
# Small, in range, and the edges: values that pass validation and reach the engine (or, for
# stop token ids past the vocabulary, that only the engine can refuse).
runnable_params = st.fixed_dictionaries(
    {"max_tokens": st.integers(1, 6) | st.just(1_000_000)},
    optional={
        "min_tokens": st.integers(0, 3),
        "temperature": st.sampled_from([0, 0.0, 1, 1e-300, 1e308, 10**30]) | st.floats(0, 2),
        "top_p": st.sampled_from([5e-324, 1.0]) | st.floats(5e-324, 1),
        "top_k": st.sampled_from([-1, 0, 1, VOCAB_SIZE, VOCAB_SIZE + 1, 10**30, 2**63]),
        "min_p": st.sampled_from([0, 1, 5e-324]) | st.floats(0, 1),
        "seed": st.sampled_from([0, -1, 2**63 - 1, -(2**63)]) | st.none(),
        "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2),
        "stop_token_ids": st.lists(st.sampled_from([0, 2, VOCAB_SIZE - 1, VOCAB_SIZE, 999999]), max_size=2),
        "ignore_eos": st.booleans(),
        "include_stop_str_in_output": st.booleans(),
        "skip_special_tokens": st.booleans(),
    },
)
prompts = st.one_of(
    st.fixed_dictionaries(
        {"prompt_token_ids": st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=8)}
    ),
    st.fixed_dictionaries({"prompt": st.text(min_size=1, max_size=40)}),
    st.fixed_dictionaries(
        {
            "messages": st.lists(
                st.fixed_dictionaries(
                    {"role": st.text(min_size=1, max_size=6), "content": st.text(max_size=20)}
                ),
                min_size=1,
                max_size=3,
            )
        }
    ),
)


@st.composite
def job_bodies(draw: st.DrawFn) -> bytes:
    """A JSON job body: nearly valid (reaches the engine) or anything shaped like a job."""
    if draw(st.integers(0, 2)) < 2:
        body: dict[str, Any] = {**draw(prompts), "params": draw(runnable_params)}
        extra = draw(st.sampled_from([None, "priority", "timeout_s", "ttl_s", "metadata"]))
        if extra is not None:
            body[extra] = draw(extreme_ints | extreme_floats | json_values)
    else:
        keys = draw(st.lists(st.sampled_from(JOB_NAMES) | st.text(max_size=6), max_size=6, unique=True))
        body = {key: draw(json_values) for key in keys}
        if draw(st.booleans()):
            names = draw(st.lists(st.sampled_from(PARAM_NAMES), max_size=6, unique=True))
            body["params"] = {name: draw(param_values) for name in names}
    text = json.dumps(body, allow_nan=True)
    if draw(st.integers(0, 9)) == 9:
        text = text[: draw(st.integers(0, len(text)))]  # cut short: not JSON any more
    return text.encode("utf-8", "surrogatepass")


field_names = st.sampled_from(
    [b"id", b"job", b"\xff\xfeid", b"jo\xffb", b"ID", b"job ", b"\x00", b""]
) | st.binary(max_size=6)
raw_values = (
    st.binary(max_size=40)
    | st.sampled_from(INVALID_UTF8)
    | st.text(max_size=20).map(lambda t: t.encode())
    | st.just(b"")
    | st.sampled_from([b"{", b"[]", b"null", b"{}", b'{"prompt": "hi"}', b"0"])
)
# Built once: drawing megabytes through hypothesis would be slow and pointless.
NASTY_BODIES = [
    b"x" * HUGE,
    b"[" * 200_000,
    b'{"prompt": "hi", "metadata": ' + b"[" * 5_000 + b"]" * 5_000 + b"}",
    b'{"prompt": "hi", "metadata": ' + b"[" * 300 + b"]" * 300 + b"}",
    b'{"prompt": "hi", "metadata": {"a": "\\ud800"}}',
    b'{"prompt": "hi", "\\udfff": 1}',
    b'{"id": "\\ud800", "prompt": "hi"}',
    json.dumps({"prompt": "y" * 900_000, "params": {"max_tokens": 1}}).encode(),
    json.dumps(
        {"prompt_token_ids": [1, 2, 3], "params": {"min_tokens": 2, "stop_token_ids": [999999]}}
    ).encode(),
    json.dumps({"prompt_token_ids": [1, 2, 3], "params": {"temperature": 1, "top_k": 10**30}}).encode(),
    json.dumps({"prompt_token_ids": [1, 2, 3], "params": {"seed": 10**30}}).encode(),
    json.dumps({"prompt_token_ids": [1, 2, 3], "params": {"temperature": 1e-300, "max_tokens": 4}}).encode(),
]


@st.composite
def fuzz_entries(draw: st.DrawFn) -> Entry:
    kind = draw(st.sampled_from(["job", "job", "job", "fields", "nasty"]))
    fields: dict[bytes, bytes] = {}
    if kind == "fields":  # any names and values, including none of the known ones
        for _ in range(draw(st.integers(1, 3))):
            fields[draw(field_names)] = draw(raw_values)
    else:
        body = draw(st.sampled_from(NASTY_BODIES)) if kind == "nasty" else draw(job_bodies())
        fields[b"job"] = body
    id_kind = draw(st.sampled_from(["unique"] * 5 + ["none"] * 2 + ["invalid", "long", "empty", "surrogate"]))
    if id_kind == "unique":
        fields[b"id"] = f"fz-{uuid.uuid4().hex}".encode()
    elif id_kind == "invalid":
        fields[b"id"] = draw(st.sampled_from(INVALID_UTF8)) + b"id"
    elif id_kind == "long":
        fields[b"id"] = b"L" * 300
    elif id_kind == "empty":
        fields[b"id"] = b""
    elif id_kind == "surrogate":
        fields[b"id"] = b"\xed\xa0\x80"  # a lone surrogate's would-be UTF-8
    if draw(st.booleans()):
        fields[draw(field_names)] = draw(raw_values)  # a stray field, maybe over a known one
    return Entry(fields, kind=kind)


@st.composite
def good_jobs(draw: st.DrawFn) -> Entry:
    num_tokens = draw(st.integers(1, 6))
    params = {"max_tokens": num_tokens, "ignore_eos": True, "temperature": draw(st.sampled_from([0, 1.0]))}
    prompt = draw(
        st.sampled_from(
            [
                {"prompt_token_ids": [1, 520, 3000, 17]},
                {"prompt": "Why is the sky blue?"},
                {"messages": [{"role": "user", "content": "Hi"}]},
            ]
        )
    )
    body = json.dumps({**prompt, "params": params}).encode()
    return Entry(
        {b"id": f"good-{uuid.uuid4().hex}".encode(), b"job": body}, num_tokens=num_tokens, kind="good"
    )


batches = st.lists(fuzz_entries(), min_size=8, max_size=14).flatmap(
    lambda entries: st.lists(good_jobs(), min_size=1, max_size=3).map(lambda good: entries + good)
)


def generate(num_batches: int, seed: int | None) -> list[Entry]:
    """About 13 entries per batch, drawn by hypothesis: a fixed sequence when `seed` is None."""
    drawn: list[list[Entry]] = []

    @settings(
        max_examples=num_batches,
        database=None,
        deadline=None,
        derandomize=seed is None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(batches.flatmap(st.permutations))
    def collect(batch: list[Entry]) -> None:
        drawn.append(batch)

    if seed is not None:
        collect = hypothesis_seed(seed)(collect)
    collect()
    return [entry for batch in drawn for entry in batch]


# -- running and checking ----------------------------------------------------------------------


def write_entries(redis: Any, stream: str, entries: list[Entry]) -> list[str]:
    message_ids = []
    for entry in entries:
        message_ids.append(redis.xadd(stream, entry.fields).decode())
    return message_ids


def run_burst_worker(url: str, model_dir: Path, log_path: Path, timeout_s: float) -> int:
    """`qworker worker --burst` on the stream until it has nothing left; its exit code."""
    with open(log_path, "w") as log:
        process = subprocess.run(
            [
                sys.executable,
                "-m",
                "qworker",
                "worker",
                "--queue",
                url,
                "--model",
                str(model_dir),
                "--name",
                "fuzzed",
                "--dtype",
                "float32",
                "--device",
                "cpu",
                "--burst",
                *WORKER_ARGS,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"},
            timeout=timeout_s,
        )
    return process.returncode


def _envelope_id(raw: bytes | None) -> tuple[str | None, bool]:
    """(the id the entry's `id` field gives, whether the field is unusable)."""
    if not raw:
        return None, False
    try:
        text = raw.decode()
    except UnicodeDecodeError:
        return None, True
    return (text, False) if len(text) <= 256 else (None, True)


def check_outcomes(redis: Any, url: str, entries: list[Entry], message_ids: list[str]) -> Outcomes:
    """Every entry ended with exactly one outcome (one dead letter, or a stored result under its job
    id), every good job completed, nothing is left in the stream or pending, and no result is an
    internal error (every value validation let through ran)."""
    params = parse_url(url, SOURCE_PARAMS | SINK_PARAMS).params
    stream, group, prefix = params["stream"], params["group"], params["prefix"]
    out = Outcomes(num_entries=len(entries))
    pending = redis.xpending(stream, group)["pending"]
    if pending:
        out.problems.append(f"{pending} entries still pending")
    if redis.xlen(stream):
        out.problems.append(f"{redis.xlen(stream)} entries left in the stream")
    dead = Counter(
        fields[b"message_id"].decode() for _, fields in redis.xrange(constants.dead_letter_stream(stream))
    )
    for message_id, count in dead.items():
        if count != 1:
            out.problems.append(f"{message_id}: dead-lettered {count} times")
    for entry, message_id in zip(entries, message_ids, strict=True):
        envelope_id, is_bad_id = _envelope_id(entry.fields.get(b"id"))
        if message_id in dead:
            out.num_dead_lettered += 1
            if entry.num_tokens is not None:
                out.problems.append(f"good job {envelope_id} was dead-lettered")
            continue
        if is_bad_id:
            out.problems.append(f"{message_id}: an unusable id field, yet not dead-lettered")
            continue
        job_id = resolve_job_id(
            envelope_id, entry.fields.get(b"job", b""), f"redis-stream:{stream}", message_id
        )
        raw = redis.get(constants.result_key(prefix, job_id)) if job_id is not None else None
        if raw is None:
            out.problems.append(f"{message_id} ({entry.kind}): no result and no dead letter")
            continue
        out.num_results += 1
        result = JobResult.model_validate_json(raw)
        out.num_completed += result.status is JobStatus.COMPLETED
        if result.error is not None:
            out.error_types[result.error.type] += 1
            if result.error.type == "InternalError":
                out.problems.append(f"{job_id}: internal error: {result.error.message}")
        if entry.num_tokens is not None:
            if result.status is not JobStatus.COMPLETED or len(result.token_ids) != entry.num_tokens:
                out.problems.append(
                    f"good job {job_id}: {result.status.value}, {len(result.token_ids)} tokens"
                )
            else:
                out.num_good_completed += 1
    return out
