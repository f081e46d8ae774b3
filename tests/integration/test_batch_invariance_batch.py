"""`qworker batch` locally (batch invariance on by default there) and `qworker batch --queue`
across two `--batch-invariant` workers that take 4 rows at a time (other batch compositions) give
identical output bodies, ids and timestamps aside: the real SmolLM2 in bf16, on the real Redis."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib
from typer.testing import CliRunner

from qworker import cli
from qworker.backends.connections import SINK_PARAMS, SOURCE_PARAMS, parse_url
from qworker.testing.worker_kit import cleanup, redis_base_url, spawn_worker, unique_url
from tests.integration.batch_support import mixed_rows, write_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROWS = mixed_rows(24, max_tokens=(4, 12))
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
    result = CliRunner().invoke(cli.app, ["batch", "-i", str(source), "-o", str(local), *work, *ENGINE])
    assert result.exit_code == 0, result.output
    workers: list[subprocess.Popen] = []
    try:
        for name in ("w1", "w2"):
            workers.append(
                spawn_worker(
                    url,
                    Path("smollm2"),
                    name,
                    "--dtype",
                    "bfloat16",
                    "--batch-invariant",
                    "--max-num-seqs",
                    "4",
                    log_path=tmp_path / f"{name}.log",
                )
            )
        pooled = tmp_path / "pool.jsonl"
        result = CliRunner().invoke(
            cli.app, ["batch", "-i", str(source), "-o", str(pooled), "--queue", url, *work, "--batch-id", "p"]
        )
        assert result.exit_code == 0, result.output
        assert "without --batch-invariant" not in result.output
    finally:
        for process in workers:
            process.send_signal(signal.SIGTERM)
        for process in workers:
            process.wait(timeout=60)
    local_bodies, pool_bodies = bodies(local), bodies(pooled)
    assert len(local_bodies) == len(ROWS)
    assert pool_bodies == local_bodies
