"""A batch whose driver keeps failing ends `failed` after --max-batch-attempts drivers, with the
last error in its `errors`, instead of being retried forever. No worker and no HTTP: the batch
driver of a gateway (AsyncApi, as create_app opens it) on the real Redis and a local file store.

The batch passed validation, then its input file went bad in the file store (bytes that are not
JSON): every driver that takes it fails reading its rows, as a driver would on any error that
does not go away by itself.
"""

from __future__ import annotations

import time

import pytest
import redis as redis_lib

from qworker.backends.connections import SINK_PARAMS, SOURCE_PARAMS, parse_url
from qworker.gateway.async_api.batch_driver import attempts_key
from qworker.gateway.async_api.objects import BATCH_KIND, BatchStatus, batch_object, set_status
from qworker.gateway.async_api.services import AsyncApi
from qworker.gateway.settings import GatewaySettings
from qworker.jobs.client import Client
from qworker.testing.worker_kit import cleanup, redis_base_url, unique_url

MAX_ATTEMPTS = 3


@pytest.mark.timeout(60)
def test_a_batch_whose_driver_keeps_failing_ends_failed_with_the_reason(tmp_path):
    url = unique_url(redis_base_url(), "gw-attempts")
    settings = GatewaySettings(
        model="m", files_url=str(tmp_path / "files"), max_batch_attempts=MAX_ATTEMPTS, batch_lease_s=2
    )
    try:
        with Client(queue=url) as client:
            api = AsyncApi.open(settings, client, work_dir=tmp_path / "work")
            records = api.require_records()
            writer = api.files.writer("file-gone-bad")
            writer.write(b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", "bo\n')
            writer.commit()
            batch = batch_object("batch_attempts", "/v1/completions", "file-gone-bad", "24h", None)
            set_status(batch, BatchStatus.IN_PROGRESS)
            batch["request_counts"]["total"] = 1
            records.create(BATCH_KIND, batch["id"], "public", {"owner": "public", "batch": batch})
            records.activate(BATCH_KIND, batch["id"])
            api.start()
            try:
                deadline = time.monotonic() + 45
                while (stored := records.get(BATCH_KIND, batch["id"])["batch"])["status"] != "failed":
                    assert stored["status"] == "in_progress", stored
                    assert time.monotonic() < deadline, "the failing batch was still retried"
                    time.sleep(0.1)
            finally:
                api.close()
            assert batch["id"] not in records.active_ids(BATCH_KIND)
            assert not records.redis.exists(attempts_key(records, batch["id"]))
    finally:
        cleanup(redis_lib.Redis.from_url(parse_url(url, SOURCE_PARAMS | SINK_PARAMS).connection_url), url)
    [error] = stored["errors"]["data"]
    assert error["code"] == "batch_driver_failed"
    assert f"failed {MAX_ATTEMPTS} times" in error["message"]
    assert "JSONDecodeError" in error["message"], error["message"]  # the last error, named
    assert stored["failed_at"] is not None and stored["output_file_id"] is None
