"""`qworker batch` locally (batch invariance on by default there) and `qworker batch --queue`
through a `--batch-invariant` worker that takes 4 rows at a time (other batch compositions) give
identical output bodies, ids and timestamps aside: the real SmolLM2 in bf16, on the real Redis.

This is the suite's worker-level check of bf16 batch invariance (the resume and redelivery tests
run fp32). The 12 rows (chat, text and token-id completions; two ask n=2, two logprobs, whose
floats must match exactly) are 12 requests at once locally and at most 4 at a time in the
worker; the worker loads its model while the local run computes. Rows split across two workers
are test_batch_pool.py's."""

from __future__ import annotations

import json
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib
from typer.testing import CliRunner

from qworker import cli
from qworker.backends.connections import SINK_PARAMS, SOURCE_PARAMS, parse_url
from qworker.testing.worker_kit import cleanup, kill_group, redis_base_url, spawn_worker, unique_url
from tests.integration.batch_support import mixed_rows, write_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROWS = mixed_rows(12, max_tokens=(4, 10))
ENGINE = ("--model", "smollm2", "--dtype", "bfloat16", "--device", "cpu")


@pytest.fixture
def url():
    url = unique_url(redis_base_url(), tag="invariant-batch")
    yield url
    cleanup(redis_lib.Redis.from_url(parse_url(url, SOURCE_PARAMS | SINK_PARAMS).connection_url), url)


def bodies(path: Path) -> dict[str, Any]:
    """custom_id -> the response body without its id, creation time and cached tokens (what that
    engine's prefix cache held)."""
    out = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        body = row["response"]["body"]
        for key in ("id", "created"):
            body.pop(key, None)
        body.get("usage", {}).pop("prompt_tokens_details", None)
        out[row["custom_id"]] = body
    return out


def test_local_and_pool_runs_give_the_same_bodies(url: str, tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", ROWS)
    local = tmp_path / "local.jsonl"
    work = ("--served-model-name", "smollm2", "--work-dir", str(tmp_path / "work"))
    worker_args = ("--dtype", "bfloat16", "--batch-invariant", "--max-num-seqs", "4")
    with ThreadPoolExecutor(max_workers=1) as starter:
        starting = starter.submit(
            spawn_worker, url, Path("smollm2"), "w1", *worker_args, log_path=tmp_path / "w1.log"
        )
        try:
            result = CliRunner().invoke(
                cli.app, ["batch", "-i", str(source), "-o", str(local), *work, *ENGINE]
            )
            assert result.exit_code == 0, result.output
            worker = starting.result()
        except BaseException:
            if starting.exception() is None:
                kill_group(starting.result())
            raise
    try:
        pooled = tmp_path / "pool.jsonl"
        result = CliRunner().invoke(
            cli.app, ["batch", "-i", str(source), "-o", str(pooled), "--queue", url, *work, "--batch-id", "p"]
        )
        assert result.exit_code == 0, result.output
        assert "without --batch-invariant" not in result.output
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=60)
    local_bodies, pool_bodies = bodies(local), bodies(pooled)
    assert len(local_bodies) == len(ROWS)
    assert pool_bodies == local_bodies
