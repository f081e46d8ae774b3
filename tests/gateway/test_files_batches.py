"""OpenAI's Files and Batches API on the gateway, driven by the official openai client, unchanged:
upload, create, poll, download; the output equals what `qworker batch` writes locally for the same
rows; cancel mid-run; list pages; a gateway SIGKILLed mid-batch and replaced by another (another
work directory: nothing local survives) completes the batch with one line per custom_id and no
row enqueued twice; bad files fail with their line numbers; limits, ownership, idempotency.

One worker (the tiny random model, greedy fp32, batch-invariant, one thread, four rows at a time)
and one gateway process serve the module; the gateway runs as `qworker gateway`, so that it can
be SIGKILLed.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis as redis_lib

from qworker.backends.connections import SINK_PARAMS, SOURCE_PARAMS, parse_url
from qworker.openai.format import BatchOutputLine
from qworker.testing.worker_kit import cleanup, redis_base_url, spawn_worker, unique_url
from tests.gateway.conftest import free_port
from tests.integration.batch_support import (
    CHAT_URL,
    COMPLETIONS_URL,
    ENGINE_ARGS,
    LOGPROB_TOLERANCE,
    MODEL_NAME,
    batch_row,
    mixed_rows,
    write_batch_model_dir,
    write_jsonl,
)
from tests.integration.conftest import moto_server  # noqa: F401 - a fixture

KEY_A = "sk-batch-a-0123456789"
KEY_B = "sk-batch-b-0123456789"
# 60 rows: each kind (chat, text and token-id completions) with n=2 and with logprobs, and rows 24
# and 59 with both (every 3rd, 7th and 5th row of mixed_rows).
ROWS = mixed_rows(60)
MAX_FILE_BYTES = 256 * 1024
MAX_FILE_ROWS = 2000


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # One folder for the session: test_async_jobs.py uses the same model.
    return write_batch_model_dir(tmp_path_factory.getbasetemp() / "gw-tiny-model")


@pytest.fixture(scope="module")
def pool_url():
    url = unique_url(redis_base_url(), tag="gw-batch")
    yield url
    cleanup(redis_lib.Redis.from_url(parse_url(url, SOURCE_PARAMS | SINK_PARAMS).connection_url), url)


def local_batch_lines(model_dir: Path, folder: Path) -> dict[str, BatchOutputLine]:
    """custom_id -> the line `qworker batch` in local mode (run_batch, what the command runs)
    writes for ROWS, in this process with one thread."""
    import torch

    from qworker.batch.command import BatchRun, run_batch
    from qworker.config import EngineConfig
    from qworker.openai.batches.progress import ProgressMode

    source = write_jsonl(folder / "in.jsonl", ROWS)
    out = folder / "out.jsonl"
    run = BatchRun(
        input=str(source),
        output=str(out),
        served_model_names=[MODEL_NAME],
        progress=ProgressMode.NONE,
        work_dir=folder / "work",
    )
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        summary = run_batch(run, EngineConfig(model=str(model_dir), **ENGINE_ARGS))
    finally:
        torch.set_num_threads(num_threads)
    assert summary.num_run == len(ROWS) and summary.num_failed == 0, summary
    return {
        line.custom_id: line
        for line in map(BatchOutputLine.model_validate_json, out.read_text().splitlines())
    }


@pytest.fixture(scope="module")
def pool(pool_url, model_dir, tmp_path_factory):
    """The module's worker (started in the background while this process computes the local
    reference lines) and the reference: (worker log, custom_id -> local line)."""
    folder = tmp_path_factory.mktemp("gw-batch-pool")
    log = folder / "w1.log"
    started: dict[str, Any] = {}

    def start() -> None:
        try:
            started["process"] = spawn_worker(
                pool_url,
                model_dir,
                "gbw1",
                "--num-kv-blocks",
                "512",
                "--block-size",
                "16",
                "--max-num-seqs",
                "4",
                # The local reference runs batch-invariant (qworker batch turns it on locally), so
                # with the worker invariant too each row's output is the same bit for bit.
                "--batch-invariant",
                log_path=log,
            )
        except Exception as exc:
            started["error"] = exc

    starting = threading.Thread(target=start)
    starting.start()
    try:
        reference = local_batch_lines(model_dir, folder)
    finally:
        starting.join()
    if "error" in started:
        raise started["error"]
    yield log, reference
    # SIGKILL: nothing of the module's unique queue needs a drain.
    started["process"].kill()
    started["process"].wait(timeout=60)


@pytest.fixture(scope="module")
def worker(pool):
    return pool[0]


@pytest.fixture(scope="module")
def local_lines(pool):
    return pool[1]


class GatewayProcess:
    """One replica: `qworker gateway` in a subprocess on a fixed port. kill() SIGKILLs it; start()
    starts it again, with the cache (staging) folder it had (a restart) or a new one (a
    replacement on another machine)."""

    def __init__(self, url: str, files_url: str, root: Path, name: str) -> None:
        self.queue_url = url
        self.files_url = files_url
        self.root = root
        self.name = name
        self.port = free_port()
        self.process: subprocess.Popen | None = None
        self.num_starts = 0
        self.num_caches = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self, new_cache: bool = False) -> None:
        self.num_starts += 1
        self.num_caches += new_cache or self.num_caches == 0
        env = {
            **os.environ,
            "QWORKER_API_KEYS": f"{KEY_A},{KEY_B}",
            "QWORKER_CACHE_DIR": str(self.root / f"{self.name}-cache-{self.num_caches}"),
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
        }
        log = open(self.log_path, "w")  # noqa: SIM115 - the process owns it
        args = ["--queue", self.queue_url, "--port", str(self.port), "--model", MODEL_NAME]
        # Parts at most 0.2 s old: the kill tests need a stored part early in the batch.
        args += ["--files-url", self.files_url, "--batch-lease-s", "2", "--batch-part-max-age-s", "0.2"]
        args += ["--max-file-bytes", str(MAX_FILE_BYTES), "--max-file-rows", str(MAX_FILE_ROWS)]
        self.process = subprocess.Popen(
            [sys.executable, "-m", "qworker.cli", "gateway", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log_text()
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/healthz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"the gateway did not start:\n{self.log_text()}")

    @property
    def log_path(self) -> Path:
        return self.root / f"{self.name}-{self.num_starts}.log"

    def log_text(self) -> str:
        return self.log_path.read_text()[-4000:]

    def is_driving(self, batch_id: str) -> bool:
        """The replica's latest word on the batch is that it drives it (a lease can move between
        live replicas, when one stalls past the lease on a loaded machine)."""
        text = self.log_path.read_text()
        return text.rfind(f"batch {batch_id}: driving") > text.rfind(f"batch {batch_id}: lease lost")

    def kill(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(20)


@pytest.fixture(scope="module")
def files_bucket(moto_server):  # noqa: F811 - the imported fixture
    """The replicas' file store: a bucket on the moto server (S3, as several replicas need)."""
    bucket = f"qw-files-{uuid.uuid4().hex[:10]}"
    moto_server.client("s3").create_bucket(Bucket=bucket)
    return bucket, f"s3://{bucket}/files?{moto_server.query}", moto_server.client("s3")


def stored_keys(files_bucket) -> set[str]:
    bucket, _, s3 = files_bucket
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket)
    return {item["Key"] for page in pages for item in page.get("Contents") or []}


@pytest.fixture(scope="module")
def gateway(pool_url, files_bucket, tmp_path_factory):
    served = GatewayProcess(pool_url, files_bucket[1], tmp_path_factory.mktemp("gw-batch-gateway"), "a")
    served.start()
    yield served
    served.stop()


def sdk(gateway: GatewayProcess, key: str = KEY_A) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url, api_key=key, max_retries=3, timeout=30)


def upload(client: openai.OpenAI, rows: list[Any], name: str = "in.jsonl") -> str:
    text = "".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows)
    return client.files.create(file=(name, io.BytesIO(text.encode())), purpose="batch").id


def wait_for(client: openai.OpenAI, batch_id: str, statuses: set[str], timeout_s: float = 90) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        time.sleep(0.2)
    raise TimeoutError(f"batch {batch_id} still {batch.status}")


def output_lines(client: openai.OpenAI, file_id: str | None) -> list[BatchOutputLine]:
    if file_id is None:
        return []
    text = client.files.content(file_id).text
    return [BatchOutputLine.model_validate_json(line) for line in text.splitlines()]


def entries_added(url: str) -> int:
    parsed = parse_url(url, SOURCE_PARAMS | SINK_PARAMS)
    redis = redis_lib.Redis.from_url(parsed.connection_url)
    stream = parsed.params["stream"]
    return int(redis.xinfo_stream(stream)["entries-added"]) if redis.exists(stream) else 0


def comparable(line: BatchOutputLine) -> dict[str, Any]:
    """The line's response body without what names the run (ids, creation time, and the cached
    tokens, which count what that engine's prefix cache held)."""
    assert line.response is not None, line
    body = line.response.model_dump(mode="json")["body"]
    for name in ("id", "created"):
        body.pop(name, None)
    body.get("usage", {}).pop("prompt_tokens_details", None)
    return {"status_code": line.response.status_code, "body": body}


def differs_by_rounding(a: Any, b: Any) -> bool:
    """True when a and b are equal but for floats within LOGPROB_TOLERANCE; False when equal."""
    if isinstance(a, float) and isinstance(b, float):
        if abs(a - b) > LOGPROB_TOLERANCE:
            raise AssertionError(f"{a} vs {b}")
        return a != b
    if isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys()
        return any([differs_by_rounding(a[k], b[k]) for k in a])
    if isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b)
        return any([differs_by_rounding(x, y) for x, y in zip(a, b, strict=True)])
    assert a == b
    return False


@pytest.mark.timeout(180)
def test_openai_client_batches_equal_local_qworker_batch_row_by_row(gateway, worker, local_lines):
    """60 rows (chat and completions, n=2 and logprobs among them) as two batches, one per
    endpoint, as OpenAI requires; every output line equals `qworker batch`'s local line for the row."""
    client = sdk(gateway)
    chat_rows = [row for row in ROWS if row["url"] == CHAT_URL]
    completion_rows = [row for row in ROWS if row["url"] == COMPLETIONS_URL]
    batches = [
        client.batches.create(input_file_id=upload(client, rows), endpoint=url, completion_window="24h")
        for rows, url in ((chat_rows, CHAT_URL), (completion_rows, COMPLETIONS_URL))
    ]
    assert batches[0].status == "validating" and batches[0].request_counts.total == 0
    lines: list[BatchOutputLine] = []
    for batch in batches:
        done = wait_for(client, batch.id, {"completed", "failed"}, timeout_s=150)
        assert done.status == "completed", done
        total = len(chat_rows) if batch.endpoint == CHAT_URL else len(completion_rows)
        assert done.request_counts.model_dump() == {"total": total, "completed": total, "failed": 0}
        assert done.in_progress_at and done.finalizing_at and done.completed_at and done.error_file_id is None
        assert done.created_at <= done.in_progress_at <= done.finalizing_at <= done.completed_at
        batch_lines = output_lines(client, done.output_file_id)
        # As OpenAI fills them: the model, and the usage summed over the output's lines.
        usages = [line.response.body.usage for line in batch_lines if line.response is not None]
        assert done.model == MODEL_NAME and done.usage is not None
        assert done.usage.input_tokens == sum(u.prompt_tokens for u in usages) > 0
        assert done.usage.output_tokens == sum(u.completion_tokens for u in usages) > 0
        assert done.usage.total_tokens == done.usage.input_tokens + done.usage.output_tokens
        assert done.usage.input_tokens_details.cached_tokens == sum(
            u.prompt_tokens_details.cached_tokens for u in usages
        )
        # The worker runs --batch-invariant: no warning that rows may differ from a local run.
        assert not (done.metadata or {}).get("qworker_warning")
        lines += batch_lines
    assert sorted(line.custom_id for line in lines) == sorted(local_lines)
    differing = [
        line.custom_id
        for line in lines
        if differs_by_rounding(comparable(line), comparable(local_lines[line.custom_id]))
    ]
    assert not differing, f"rows that differ from the local run in their last bits: {differing}"


@pytest.mark.timeout(120)
def test_cancel_mid_run_keeps_the_finished_rows(gateway, worker):
    client = sdk(gateway)
    # Eight short rows, then 52 long ones (300 tokens, four at a time: some 3,900 steps): the
    # batch cannot end before the cancel lands, however slow the gateway is to send it.
    rows = [
        batch_row(
            f"long-{i}",
            COMPLETIONS_URL,
            {
                "model": MODEL_NAME,
                "prompt": f"Tale {i}",
                "max_tokens": 60 if i < 8 else 300,
                "temperature": 0,
                "ignore_eos": True,
            },
        )
        for i in range(60)
    ]
    batch = client.batches.create(
        input_file_id=upload(client, rows), endpoint=COMPLETIONS_URL, completion_window="24h"
    )
    deadline = time.monotonic() + 60
    while client.batches.retrieve(batch.id).request_counts.completed < 4:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at
    done = wait_for(client, batch.id, {"cancelled"})
    lines = output_lines(client, done.output_file_id)
    assert 4 <= len(lines) < 60 and done.request_counts.completed == len(lines)
    assert all(line.response is not None and line.response.status_code == 200 for line in lines)
    assert len({line.custom_id for line in lines}) == len(lines)
    assert done.cancelled_at >= done.cancelling_at


def output_parts(files_bucket, batch_id: str) -> set[str]:
    """The keys of the batch's output parts in the file store (gateway/async_api/output_parts.py)."""
    return {key for key in stored_keys(files_bucket) if f"part-{batch_id}-output-" in key}


def run_killing_the_driver(
    pool_url: str, worker: Path, replicas: list[GatewayProcess], files_bucket, seed: int, restart: bool
) -> set[str]:
    """A batch created on replicas[0]; once 4 rows are done and a part of its output is in the
    file store (written as rows finish), the replica driving it is SIGKILLed (and, with
    `restart`, started again with its work directory). The batch completes with one line per
    custom_id, every row enqueued once and none run to completion twice, and its parts are gone.
    Returns the names of the replicas that drove it."""
    client = sdk(replicas[0])
    # 24 rows long enough (96-160 tokens, four at a time: some 750 steps, six rounds) that the
    # batch outlasts the first stored part and the kill (after the first round) however fast the
    # machine: with 24-48 tokens a quiet machine finished all of them before the first part (then
    # 2 s old) was stored.
    rows = [row for row in mixed_rows(36, max_tokens=(96, 160), seed=seed) if row["url"] == COMPLETIONS_URL]
    for row in rows:
        row["body"]["ignore_eos"] = True
    num_before = entries_added(pool_url)
    batch = client.batches.create(
        input_file_id=upload(client, rows), endpoint=COMPLETIONS_URL, completion_window="24h"
    )
    deadline = time.monotonic() + 60
    while client.batches.retrieve(batch.id).request_counts.completed < 4 or not output_parts(
        files_bucket, batch.id
    ):
        assert time.monotonic() < deadline, replicas[0].log_text()
        time.sleep(0.05)
    # One replica drives it: wait out a lease that is moving (the one that lost it says so).
    drivers: list[GatewayProcess] = []
    deadline = time.monotonic() + 30
    while len(drivers := [r for r in replicas if r.is_driving(batch.id)]) != 1:
        assert time.monotonic() < deadline, [r.name for r in drivers]
        time.sleep(0.05)
    [driver] = drivers
    assert client.batches.retrieve(batch.id).request_counts.completed < len(rows), "killed midway"
    driver.kill()
    if restart:
        driver.start()
    survivor = next(r for r in replicas if r.process is not None and r.process.poll() is None)
    done = wait_for(sdk(survivor), batch.id, {"completed", "failed"}, timeout_s=120)
    assert done.status == "completed", done
    lines = output_lines(sdk(survivor), done.output_file_id)
    assert sorted(line.custom_id for line in lines) == sorted(row["custom_id"] for row in rows)
    assert done.request_counts.model_dump() == {"total": len(rows), "completed": len(rows), "failed": 0}
    # Every row was put on the queue once, and none ran to completion twice.
    assert entries_added(pool_url) - num_before == len(rows)
    assert "already had a result" not in worker.read_text()
    assert not output_parts(files_bucket, batch.id), "the parts were joined and deleted"
    return {r.name for r in replicas if f"batch {batch.id}: driving" in r.log_path.read_text()} | {
        driver.name
    }


@pytest.mark.timeout(150)
def test_a_gateway_sigkilled_mid_batch_and_restarted_completes_it(gateway, worker, pool_url, files_bucket):
    """One replica, killed and started again on its work directory: it resumes the batch."""
    run_killing_the_driver(pool_url, worker, [gateway], files_bucket, seed=7, restart=True)
    assert "driving it (in_progress)" in gateway.log_path.read_text(), "the restart carried the batch on"


@pytest.mark.timeout(150)
def test_two_replicas_one_sigkilled_mid_batch_the_other_completes_it(
    gateway, worker, pool_url, files_bucket, tmp_path
):
    """Two replicas on one queue and one S3 file store; the one driving the batch is killed, and
    the other (with none of its files) takes the batch once the lease lapses."""
    second = GatewayProcess(pool_url, files_bucket[1], tmp_path, "b")
    second.start()
    try:
        drivers = run_killing_the_driver(
            pool_url, worker, [gateway, second], files_bucket, seed=11, restart=False
        )
        assert drivers == {"a", "b"}
    finally:
        second.stop()
        if gateway.process is not None and gateway.process.poll() is not None:
            gateway.start(new_cache=True)


@pytest.mark.timeout(60)
def test_batches_list_pages_and_belong_to_their_key(gateway):
    client, other = sdk(gateway), sdk(gateway, KEY_B)
    file_id = upload(client, [batch_row("x", CHAT_URL, {"messages": [{"role": "user", "content": "hi"}]})])
    created = [
        client.batches.create(input_file_id=file_id, endpoint=CHAT_URL, completion_window="24h")
        for _ in range(3)
    ]
    for batch in created:
        client.batches.cancel(batch.id)
    first = client.batches.list(limit=2)
    assert [b.id for b in first.data] == [created[2].id, created[1].id] and first.has_more
    second = client.batches.list(limit=2, after=first.data[-1].id)
    assert second.data[0].id == created[0].id
    # Another key sees none of it.
    assert all(b.id not in {c.id for c in created} for b in other.batches.list(limit=100).data)
    assert file_id not in {f.id for f in other.files.list().data}
    with pytest.raises(openai.NotFoundError):
        other.batches.retrieve(created[0].id)
    with pytest.raises(openai.NotFoundError):
        other.files.content(file_id)
    with pytest.raises(openai.NotFoundError):
        other.batches.create(input_file_id=file_id, endpoint=CHAT_URL, completion_window="24h")


@pytest.mark.timeout(60)
def test_bad_files_fail_with_their_line_numbers(gateway):
    client = sdk(gateway)
    good = batch_row("a", CHAT_URL, {"messages": [{"role": "user", "content": "hi"}]})
    cases = {
        "not jsonl": ([good, "{this is not json"], "line 2: not JSON"),
        "duplicate": ([good, good], "line 2: custom_id 'a' repeats line 1"),
        "missing": ([good, {"method": "POST", "url": CHAT_URL, "body": {}}], "line 2: no custom_id"),
        "endpoint": (
            [good, batch_row("b", COMPLETIONS_URL, {"prompt": "x"})],
            "line 2: url '/v1/completions'",
        ),
    }
    batches = {
        name: client.batches.create(
            input_file_id=upload(client, rows), endpoint=CHAT_URL, completion_window="24h"
        )
        for name, (rows, _) in cases.items()
    }
    for name, batch in batches.items():
        done = wait_for(client, batch.id, {"failed", "completed"}, timeout_s=30)
        assert done.status == "failed", (name, done)
        assert done.failed_at and done.output_file_id is None
        [error] = done.errors.data
        assert error.line == 2 and error.message.startswith(cases[name][1]), (name, error)


@pytest.mark.timeout(60)
def test_limits_unknown_files_and_idempotency_keys(gateway, files_bucket):
    client = sdk(gateway)
    before = {f.id for f in client.files.list().data}
    stored_before = stored_keys(files_bucket)
    with pytest.raises(openai.APIStatusError) as too_big:
        client.files.create(file=("big.jsonl", io.BytesIO(b"x" * (MAX_FILE_BYTES + 1))), purpose="batch")
    assert too_big.value.status_code == 413
    with pytest.raises(openai.APIStatusError) as too_many:
        client.files.create(file=("rows.jsonl", io.BytesIO(b"{}\n" * (MAX_FILE_ROWS + 1))), purpose="batch")
    assert too_many.value.status_code == 413
    assert {f.id for f in client.files.list().data} == before
    assert stored_keys(files_bucket) == stored_before, "nothing of a refused upload is stored"
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-nope", endpoint=CHAT_URL, completion_window="24h")
    with pytest.raises(openai.BadRequestError):
        client.batches.create(input_file_id="file-nope", endpoint="/v1/moderations", completion_window="24h")
    file_id = upload(client, [batch_row("x", CHAT_URL, {"messages": [{"role": "user", "content": "hi"}]})])
    key = {"Idempotency-Key": "retry-1"}
    first = client.batches.create(
        input_file_id=file_id, endpoint=CHAT_URL, completion_window="24h", extra_headers=key
    )
    again = client.batches.create(
        input_file_id=file_id, endpoint=CHAT_URL, completion_window="24h", extra_headers=key
    )
    assert again.id == first.id
    with pytest.raises(openai.UnprocessableEntityError):
        client.batches.create(
            input_file_id=file_id,
            endpoint=CHAT_URL,
            completion_window="24h",
            metadata={"x": "y"},
            extra_headers=key,
        )
    # The key is scoped to the API key: another key's same Idempotency-Key is a new request.
    with pytest.raises(openai.NotFoundError):
        sdk(gateway, KEY_B).batches.create(
            input_file_id=file_id, endpoint=CHAT_URL, completion_window="24h", extra_headers=key
        )
    client.batches.cancel(first.id)
    assert client.files.retrieve(file_id).bytes > 0
    client.files.delete(file_id)
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(file_id)


def records_redis(pool_url: str) -> tuple[redis_lib.Redis, str]:
    parsed = parse_url(pool_url, SOURCE_PARAMS | SINK_PARAMS)
    return redis_lib.Redis.from_url(parsed.connection_url), f"{parsed.params['prefix']}:gw"


@pytest.mark.timeout(90)
def test_a_batch_past_expires_at_ends_expired_with_its_partial_output(gateway, worker, pool_url):
    client = sdk(gateway)
    # 40 rows of 160 tokens, four at a time (some 1,600 steps): the deadline moved after the
    # second row passes long before the last row, however fast the machine.
    body = {"model": MODEL_NAME, "max_tokens": 160, "temperature": 0, "ignore_eos": True}
    rows = [batch_row(f"e-{i}", COMPLETIONS_URL, {**body, "prompt": f"Saga {i}"}) for i in range(40)]
    batch = client.batches.create(
        input_file_id=upload(client, rows),
        endpoint=COMPLETIONS_URL,
        completion_window="24h",
        output_expires_after={"anchor": "created_at", "seconds": 7200},
    )
    assert batch.expires_at == batch.created_at + 24 * 3600
    deadline = time.monotonic() + 60
    while client.batches.retrieve(batch.id).request_counts.completed < 2:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    # The deadline passes (moved in the store, as 24 hours would move it; again should the
    # driver's own write of its counts cross this one).
    redis, prefix = records_redis(pool_url)
    key = f"{prefix}:obj:batch:{batch.id}"
    deadline = time.monotonic() + 60
    while (done := client.batches.retrieve(batch.id)).status not in ("expired", "completed"):
        assert time.monotonic() < deadline
        record = json.loads(redis.get(key))
        if record["batch"]["expires_at"] > time.time():
            record["batch"]["expires_at"] = int(time.time()) - 1
            redis.set(key, json.dumps(record))
        time.sleep(0.2)
    assert done.status == "expired" and done.expired_at
    lines = output_lines(client, done.output_file_id)
    assert 2 <= len(lines) < 40 and done.request_counts.completed == len(lines)
    output = client.files.retrieve(done.output_file_id)
    assert output.purpose == "batch_output" and output.expires_at == output.created_at + 7200
    with pytest.raises(openai.BadRequestError):
        client.batches.create(
            input_file_id=done.input_file_id,
            endpoint=COMPLETIONS_URL,
            completion_window="24h",
            output_expires_after={"anchor": "created_at", "seconds": 5},
        )


@pytest.mark.timeout(30)
def test_the_record_of_sent_rows_in_an_s3_result_store(files_bucket, tmp_path):
    """Results in S3: the record is one object per send under the results prefix, read back
    whole by another runner, and cleared by a --no-resume run; nothing is written locally."""
    from qworker.backends.connections import open_sink
    from qworker.openai.batches.submitted import S3Submitted, open_submitted

    files_url = files_bucket[1]
    sink = open_sink(files_url.replace("/files?", "/results?"))
    record = open_submitted(sink, "b1", tmp_path / "journal")
    assert isinstance(record, S3Submitted)
    record.add(["j1", "j2"])
    record.add(["j3"])
    again = open_submitted(sink, "b1", tmp_path / "journal")
    assert {"j1", "j2", "j3"} <= again.ids and "j4" not in again
    assert not open_submitted(sink, "b2", tmp_path / "journal").ids, "one record per batch"
    again.clear()
    assert not open_submitted(sink, "b1", tmp_path / "journal").ids
    assert not list(tmp_path.iterdir())
    assert {key for key in stored_keys(files_bucket) if "/_batches/b1/" in key} == set()
    sink.close()
