"""The batch-invariant mode's flags: `qworker batch` turns it on locally on the CPU, and in pool
mode finds the live workers whose stats show it off (a real Redis result store)."""

from __future__ import annotations

import logging

import pytest
import redis as redis_lib

from qworker.backends.connections import SINK_PARAMS, SOURCE_PARAMS, open_sink, parse_url
from qworker.batch.invariance import local_engine_config, warn_unless_pool_is_invariant
from qworker.config import EngineConfig
from qworker.openai.batches.invariance import invariance_warning, workers_without_invariance
from qworker.startup import HardwareInfo
from qworker.testing.worker_kit import cleanup, redis_base_url, unique_url
from qworker.worker.stats import WorkerStats

pytestmark = pytest.mark.timeout(30)


def test_local_batch_turns_the_mode_on_on_the_cpu() -> None:
    assert local_engine_config(EngineConfig(device="cpu")).batch_invariant
    assert not local_engine_config(EngineConfig(device="cuda")).batch_invariant
    assert local_engine_config(EngineConfig(device="cpu", batch_invariant=True)).batch_invariant


def hardware(batch_invariant: bool) -> HardwareInfo:
    return HardwareInfo("cpu", "EPYC", 2**34, "bfloat16", 10, 16, 160, batch_invariant=batch_invariant)


def test_pool_mode_names_the_workers_without_the_mode(caplog: pytest.LogCaptureFixture) -> None:
    url = unique_url(redis_base_url(), tag="invariant-flags")
    raw = redis_lib.Redis.from_url(parse_url(url, SOURCE_PARAMS | SINK_PARAMS).connection_url)
    try:
        sink = open_sink(url)
        sink.write_worker_stats("on", WorkerStats(hardware=hardware(True)))
        assert workers_without_invariance(sink) == []
        assert invariance_warning(sink) is None  # what the gateway's batch object then says: nothing
        sink.write_worker_stats("off", WorkerStats(hardware=hardware(False)))
        sink.write_worker_stats("starting", WorkerStats())  # no hardware yet: counts as off
        assert workers_without_invariance(sink) == ["off", "starting"]
        with caplog.at_level(logging.WARNING):
            warn_unless_pool_is_invariant(sink)
        assert "workers off, starting run without --batch-invariant" in caplog.text
        # The gateway's batch driver puts this in the batch object's metadata (qworker_warning).
        assert invariance_warning(sink) == (
            "workers off, starting run without --batch-invariant: rows may differ from a local qworker "
            "batch run"
        )
    finally:
        cleanup(raw, url)
