"""`qworker dlq list | show | replay | purge` on each queue backend (Redis Streams on the local
Redis, SQS through moto's server, Celery on the local Redis): a job whose prompt is too long for
the worker's --max-model-len is dead-lettered with a failed result; after the worker comes back
with a longer context, replay puts it back and it completes as a first attempt."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import redis as redis_lib
from typer.testing import CliRunner

from qworker.backends.connections import open_sink, open_source
from qworker.cli import app
from qworker.config import EngineConfig
from qworker.engine.llm_engine import LLMEngine
from qworker.jobs.client import Client
from qworker.jobs.job import JobStatus
from qworker.testing.worker_kit import cleanup, redis_base_url, unique_url
from qworker.worker.loop import Worker
from qworker.worker.settings import WorkerSettings

SHORT_CONTEXT = 32
LONG_CONTEXT = 128
LONG_PROMPT = list(range(10, 60))  # 50 tokens: over SHORT_CONTEXT, within LONG_CONTEXT
CELERY_BROKER = redis_base_url(11)


@dataclass
class Backend:
    queue_url: str
    results_url: str


@pytest.fixture(params=["redis", "sqs", "celery"])
def backend(request, sqs_s3) -> Iterator[Backend]:
    if request.param == "redis":
        url = unique_url(redis_base_url(), "dlq")
        yield Backend(url, url)
        cleanup(redis_lib.Redis.from_url(url.split("?")[0]), url)
    elif request.param == "sqs":
        env = sqs_s3()
        yield Backend(env.queue_url, env.results_url)
    else:
        queue = f"qwtest-dlq-{uuid.uuid4().hex[:10]}"
        url = f"celery+{CELERY_BROKER}?queue={queue}"
        yield Backend(url, url)
        broker = redis_lib.Redis.from_url(CELERY_BROKER)
        for pattern in (f"{queue}*", f"_kombu.binding.{queue}*", f"celery-task-meta-{RUN}-*"):
            for key in broker.scan_iter(match=pattern, count=1000):
                broker.delete(key)


def run_worker(tiny_model_dir, backend: Backend, max_model_len: int):
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_model_dir),
            dtype="float32",
            device="cpu",
            num_kv_blocks=64,
            block_size=16,
            max_model_len=max_model_len,
        )
    )
    worker = Worker(
        engine,
        open_source(backend.queue_url, consumer="w"),
        open_sink(backend.results_url),
        WorkerSettings(name="w"),
    )
    return worker.run(burst=True)


def dlq(*args: str, input: str | None = None):
    return CliRunner().invoke(app, ["dlq", *args], input=input, catch_exceptions=False)


# Job ids differ per run: Celery's result keys (celery-task-meta-{id}) are not per queue.
RUN = uuid.uuid4().hex[:8]


def job(job_id: str, prompt: list[int]) -> dict:
    return {
        "id": f"{RUN}-{job_id}",
        "prompt_token_ids": prompt,
        "params": {"max_tokens": 2, "ignore_eos": True},
    }


@pytest.mark.timeout(180)
def test_too_long_prompt_is_dead_lettered_then_replayed_on_a_longer_context(backend, tiny_model_dir):
    with Client(queue=backend.queue_url, results=backend.results_url) as client:
        client.submit(job("long", LONG_PROMPT))
        client.submit(job("short", [5, 6, 7]))
        stats = run_worker(tiny_model_dir, backend, SHORT_CONTEXT)
        assert stats.num_dead_lettered == 1 and stats.num_completed == 1
        failed = client.result(f"{RUN}-long", timeout=5)
        assert failed.status is JobStatus.FAILED and failed.error.type == "PromptTooLongError"

        listed = dlq("list", "--queue", backend.queue_url, "--json")
        assert listed.exit_code == 0, listed.output
        rows = [json.loads(line) for line in listed.output.splitlines()]
        assert len(rows) == 1 and rows[0]["job_id"] == f"{RUN}-long" and "PromptTooLongError" not in rows[0]
        assert "context" in rows[0]["reason"] or "long" in rows[0]["reason"]
        assert rows[0]["attempts"] == 1 and rows[0]["age_s"] >= 0
        table = dlq("list", "--queue", backend.queue_url)
        assert table.output.split("\t")[:3] == [rows[0]["id"], f"{RUN}-long", "1"]

        shown = dlq("show", rows[0]["id"], "--queue", backend.queue_url)
        assert shown.exit_code == 0, shown.output
        assert json.loads(json.loads(shown.output)["body"])["prompt_token_ids"] == LONG_PROMPT
        assert dlq("show", "no-such-id", "--queue", backend.queue_url).exit_code == 1

        # Without a longer context the replayed job would fail again; with one it completes.
        replayed = dlq(
            "replay", rows[0]["id"], "--queue", backend.queue_url, "--results", backend.results_url
        )
        assert replayed.exit_code == 0, replayed.output
        assert dlq("list", "--queue", backend.queue_url, "--json").stdout.strip() == ""
        stats = run_worker(tiny_model_dir, backend, LONG_CONTEXT)
        assert stats.num_completed == 1 and stats.num_skipped_done == 0 and stats.num_dead_lettered == 0
        done = client.result(f"{RUN}-long", timeout=5)
        assert done.status is JobStatus.COMPLETED and done.attempts == 1 and len(done.token_ids) == 2
        assert client.result(f"{RUN}-short", timeout=5).status is JobStatus.COMPLETED


@pytest.mark.timeout(180)
def test_purge_asks_first_and_replay_all(backend, tiny_model_dir):
    with Client(queue=backend.queue_url, results=backend.results_url) as client:
        for i in range(3):
            client.submit(job(f"long{i}", LONG_PROMPT))
        assert run_worker(tiny_model_dir, backend, SHORT_CONTEXT).num_dead_lettered == 3
    assert len(dlq("list", "--queue", backend.queue_url).output.splitlines()) == 3
    refused = dlq("purge", "--queue", backend.queue_url, input="n\n")
    assert refused.exit_code != 0 and "remove 3 dead letters?" in refused.output
    assert len(dlq("list", "--queue", backend.queue_url).output.splitlines()) == 3
    # Replay --all with no results change, then dead-letter them again, then purge.
    assert dlq("replay", "--queue", backend.queue_url).exit_code != 0  # neither ids nor --all
    replayed = dlq("replay", "--all", "--queue", backend.queue_url, "--results", backend.results_url)
    assert replayed.output.count("replayed") == 3, replayed.output
    assert run_worker(tiny_model_dir, backend, SHORT_CONTEXT).num_dead_lettered == 3
    purged = dlq("purge", "--yes", "--queue", backend.queue_url)
    assert purged.exit_code == 0 and "removed 3" in purged.output
    # Empty: list says so, and purge has nothing to ask about.
    empty = dlq("list", "--queue", backend.queue_url)
    assert empty.stdout.strip() == "" and empty.stderr.strip() == "no dead letters"
    nothing = dlq("purge", "--queue", backend.queue_url)
    assert nothing.exit_code == 0 and nothing.output.strip() == "no dead letters to remove"


@pytest.mark.timeout(120)
def test_replay_names_the_job_id_or_says_the_body_is_no_job(tiny_model_dir):
    url = unique_url(redis_base_url(), "dlq-ids")
    r = redis_lib.Redis.from_url(url.split("?")[0])
    stream = url.split("stream=", 1)[1].split("&", 1)[0]
    try:
        # One entry with neither an id nor a JSON body: dead-lettered with no job id.
        r.xadd(stream, {"body": b"\xffnot a job"})
        with Client(queue=url) as client:
            client.submit(job("long-id", LONG_PROMPT))
        assert run_worker(tiny_model_dir, Backend(url, url), SHORT_CONTEXT).num_dead_lettered == 2
        replayed = dlq("replay", "--all", "--queue", url, "--results", url)
        assert replayed.exit_code == 0, replayed.output
        assert f"as job {RUN}-long-id" in replayed.output
        assert "its body is not a job, so the worker will dead-letter it again" in replayed.output
    finally:
        cleanup(r, url)
