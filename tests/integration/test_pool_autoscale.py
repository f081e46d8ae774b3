"""An autoscaled pool on loopback: the test plays KEDA and the HPA (tests/pool_emulator/autoscale.py) on the
pool-demand signal, read every second over HTTP from the exporter's own loop, and starts and stops
real worker processes (1 torch thread each, at most 2 at once) while bursts of 60 to 110 small
jobs and a trickle of longer ones arrive on the suite's Redis server (tests/conftest.py). The
scenario (tests/pool_emulator/scenario.py, bursty_config, with smaller bursts: see
scenario_config) scales 0 -> 2 -> 1 -> 0 -> 1 -> 0: the scale-in to 1 happens at the burst's tail
or during the trickle and removes the worker holding the most jobs, with a drain grace shorter
than what is left of them, so that it releases them to its peer; the last burst comes when the
pool is at 0 and brings it back up from zero."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest
import redis as redis_lib

from qworker.backends.connections import SINK_PARAMS, SOURCE_PARAMS, parse_url
from qworker.jobs.job import JobStatus
from qworker.testing.worker_kit import cleanup, redis_base_url, unique_url
from tests.pool_emulator.scenario import ScenarioConfig, ScenarioRun, bursty_config, run_scenario

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def scenario_config() -> ScenarioConfig:
    """bursty_config with smaller bursts, its trickle and quiet gap as they are:

    - the first burst from 160 short jobs to 110 (about 510 blocks: the signal still asks for 2
      workers, the target being 410 blocks a worker);
    - the last burst, from zero again, from 120 short jobs to 60 (about 280 blocks: one worker,
      one cold start instead of two at once).

    The trickle (25 long jobs over 25 s) stays: on a quiet machine the burst is done before the
    scale-in, which then finds jobs to release only in a trickle still under way (a trickle of 15
    over 15 s once left nothing to release in CI).
    """
    config = bursty_config()
    cuts: dict[str, dict[str, Any]] = {"burst-1": {"num_jobs": 110}, "last-burst": {"num_jobs": 60}}
    bursts = tuple(replace(burst, **cuts.get(burst.name, {})) for burst in config.bursts)
    assert {b.name for b in bursts} >= cuts.keys()
    return replace(config, bursts=bursts)


def report(run: ScenarioRun) -> str:
    lines = [run.format_timeline(), json.dumps(run.summary(), indent=1)]
    lines += [json.dumps(w) for w in run.workers]
    return "\n".join(lines)


@pytest.fixture
def queue_url():
    url = unique_url(redis_base_url(), tag="autoscale")
    yield url
    cleanup(redis_lib.Redis.from_url(parse_url(url, SOURCE_PARAMS | SINK_PARAMS).connection_url), url)


def test_pool_scales_from_zero_to_two_and_back_and_every_job_completes_once(
    tiny_model_dir, queue_url, tmp_path
):
    config = scenario_config()
    run = run_scenario(queue_url, str(tiny_model_dir), config, tmp_path)
    text = report(run)
    print(text)  # the timeline: shown with -s, and in the report of a failure
    (tmp_path / "timeline.txt").write_text(text)
    summary = run.summary()
    logs = f"worker logs in {tmp_path}"
    assert not run.is_timed_out, f"the run did not finish within {config.timeout_s}s; {logs}"

    # 0 -> N -> 0, twice: from zero at the first burst, to zero in the quiet gap, from zero again.
    path = summary["replica_path"]
    assert path[0] == 0 and path[-1] == 0, path
    assert summary["max_replicas"] == config.policy.max_replicas, path
    last_burst_s = run.burst_started_s[config.bursts[-1].name]
    before_last = [r.replicas for r in run.rows if r.t_s < last_burst_s]
    assert before_last[-1] == 0, f"the pool was not at zero when the last burst arrived: {path}"
    assert max(before_last) == config.policy.max_replicas and max(r.signal_desired for r in run.rows) >= 2
    # Never more processes than the machine has room for (draining ones count).
    assert all(r.num_ready + r.num_starting + r.num_draining <= config.max_processes for r in run.rows)

    # Every job has exactly one result, completed; nothing else was stored under the run's prefix.
    assert summary["num_jobs"] == sum(b.num_jobs for b in config.bursts)
    assert summary["num_results"] == summary["num_result_keys"] == summary["num_jobs"], logs
    assert summary["statuses"] == {JobStatus.COMPLETED.value: summary["num_jobs"]}
    # ...and ran to completion once: the workers' own counts add up to the jobs, and no
    # redelivered job found a result already there.
    assert summary["num_completed_by_workers"] == summary["num_jobs"], logs
    assert summary["num_skipped_done"] == 0 and summary["num_leases_lost"] == 0

    # Every worker that was SIGTERMed drained and exited 0.
    assert all(w["exit_code"] == 0 for w in run.workers if w["ready_s"] is not None), run.workers

    # The scale-in during the trickle released the removed worker's jobs; each was delivered once
    # more and completed by a worker that was not draining when it started it.
    releasers = [w for w in run.workers if w["num_released"]]
    assert summary["num_released"] >= 1, f"no scale-in released anything: {run.workers}"
    assert all(w["num_held_at_drain"] >= w["num_released"] for w in releasers)
    assert summary["num_extra_deliveries"] == summary["num_released"], summary["attempts"]
    terminated_s = {w["name"]: w["terminated_s"] for w in run.workers}
    retried = [r for r in run.results.values() if r.attempts > 1]
    for result in run.results.values():
        assert result.timings.started_at is not None
        started_s = result.timings.started_at - run.started_wall
        stopped_s = terminated_s[result.worker]
        assert stopped_s is None or started_s < stopped_s, f"{result.worker} took {result.id} while draining"
    for result in retried:
        started_s = result.timings.started_at - run.started_wall
        assert any(w["terminated_s"] < started_s for w in releasers), (
            f"{result.id} retried before any release"
        )
