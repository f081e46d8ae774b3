"""An autoscaled pool on one machine: bursts of jobs arrive on a Redis Stream, `qworker
metrics-exporter`'s code serves the pool-demand signal over HTTP, the autoscaler (autoscale.py)
reads it every poll as KEDA's metrics-api scaler would, and a WorkerPool (worker_pool.py) starts and
stops real worker processes to match. The run records a timeline (replicas, demand, queue depth,
queue wait) and every job's one result, for tests/integration/test_pool_autoscale.py and
scripts/pool_autoscale.py.
"""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from qworker.backends.connections import SINK_PARAMS, SOURCE_PARAMS, parse_url, redis_client
from qworker.backends.redis import keys as constants
from qworker.jobs.job import JobResult
from qworker.pool.demand import PoolSizing
from qworker.pool.exporter import run_metrics_exporter
from tests.pool_emulator.autoscale import Autoscaler, ScalingPolicy
from tests.pool_emulator.worker_pool import Victim, WorkerPool

# Polls at 0 workers with no demand and results missing after which a run ends (the signal can
# lag the last submission by an exporter interval; a few polls cover that).
LOST_WORK_POLLS = 5


@dataclass(frozen=True)
class Burst:
    """`num_jobs` jobs arriving from `at_s` on, evenly over `spread_s` (0: all at once). `at_s`
    counts from the run's start or, with `after`, from the moment `after_done_fraction` of the
    jobs of the burst named `after` have their results: a phase keyed to progress instead of the
    clock plays out the same on a slow or busy machine. Bursts are played in their order."""

    name: str
    at_s: float
    num_jobs: int
    spread_s: float = 0.0
    # Inclusive ranges, drawn uniformly per job.
    prompt_tokens: tuple[int, int] = (8, 48)
    max_tokens: tuple[int, int] = (16, 64)
    after: str | None = None
    after_done_fraction: float = 1.0


@dataclass(frozen=True)
class PlannedJob:
    # Seconds after its burst starts.
    offset_s: float
    burst: str
    job: dict[str, Any]


@dataclass(frozen=True)
class ScenarioConfig:
    bursts: tuple[Burst, ...]
    policy: ScalingPolicy
    sizing: PoolSizing
    # Flags of every worker (its KV pool must match sizing.capacity_blocks).
    worker_args: tuple[str, ...]
    poll_interval_s: float = 1.0
    exporter_interval_s: float = 0.5
    max_processes: int = 2
    victim: Victim = Victim.NEWEST
    num_threads: int = 1
    seed: int = 0
    # The run ends when every job has its result and the pool is back at 0, or after this.
    timeout_s: float = 300.0


@dataclass
class TimelineRow:
    t_s: float
    # The target's replica count after this poll's decision, and what its processes are doing.
    replicas: int
    num_ready: int
    num_starting: int
    num_draining: int
    demand_blocks: float
    # The exporter's qworker_pool_desired_workers (the signal, unbounded) and the HPA's count.
    signal_desired: float
    hpa_desired: int
    waiting_jobs: float
    running_jobs: float
    num_submitted: int
    num_done: int
    # Queue wait (start - enqueue) of the jobs that started since the previous row; filled in
    # after the run from the stored results.
    num_started: int = 0
    queue_wait_p50_s: float | None = None
    queue_wait_p99_s: float | None = None


@dataclass
class ScenarioRun:
    config: ScenarioConfig
    rows: list[TimelineRow]
    # Job id -> (burst, submitted at, seconds since the start).
    submitted: dict[str, tuple[str, float]]
    results: dict[str, JobResult]
    # Result keys under the run's prefix: one per job id when nothing was stored twice or stray.
    num_result_keys: int
    workers: list[dict[str, Any]]
    is_timed_out: bool
    # Burst name -> when it started, seconds since the run's start.
    burst_started_s: dict[str, float] = field(default_factory=dict)
    started_wall: float = 0.0
    notes: dict[str, Any] = field(default_factory=dict)

    def queue_wait_s(self, result: JobResult) -> float | None:
        t = result.timings
        if t.started_at is None or t.enqueued_at is None:
            return None
        return t.started_at - t.enqueued_at

    def replica_path(self) -> list[int]:
        """The replica counts the run went through, repeats dropped: [0, 1, 2, 1, 0, ...]."""
        path: list[int] = [0]
        for row in self.rows:
            if row.replicas != path[-1]:
                path.append(row.replicas)
        return path

    def summary(self) -> dict[str, Any]:
        results = list(self.results.values())
        waits = [w for r in results if (w := self.queue_wait_s(r)) is not None]
        per_burst: dict[str, list[float]] = {}
        for job_id, (burst, _) in self.submitted.items():
            result = self.results.get(job_id)
            wait = self.queue_wait_s(result) if result is not None else None
            if wait is not None:
                per_burst.setdefault(burst, []).append(wait)

        def stat(key: str) -> int:
            return sum(w.get(key) or 0 for w in self.workers)

        return {
            "num_jobs": len(self.submitted),
            "num_results": len(self.results),
            "num_result_keys": self.num_result_keys,
            "statuses": dict(Counter(r.status.value for r in results)),
            "attempts": dict(Counter(r.attempts for r in results)),
            "num_extra_deliveries": sum(r.attempts - 1 for r in results),
            "num_completed_by_workers": stat("num_completed"),
            "num_released": stat("num_released"),
            "num_skipped_done": stat("num_skipped_done"),
            "num_leases_lost": stat("num_leases_lost"),
            "replica_path": self.replica_path(),
            "max_replicas": max((row.replicas for row in self.rows), default=0),
            "cold_starts_s": [round(w["cold_start_s"], 2) for w in self.workers if w["cold_start_s"]],
            "queue_wait_s": _percentiles(waits),
            "queue_wait_s_by_burst": {name: _percentiles(ws) for name, ws in per_burst.items()},
            "duration_s": self.rows[-1].t_s if self.rows else 0.0,
            "is_timed_out": self.is_timed_out,
        }

    def format_timeline(self) -> str:
        header = (
            f"{'t_s':>6} {'repl':>4} {'ready':>5} {'drain':>5} {'demand':>7} {'signal':>6} {'hpa':>3} "
            f"{'waiting':>7} {'running':>7} {'sent':>5} {'done':>5} {'qwait_p50':>9} {'qwait_p99':>9}"
        )
        lines = [header]
        for r in self.rows:
            lines.append(
                f"{r.t_s:6.1f} {r.replicas:4d} {r.num_ready:5d} {r.num_draining:5d} {r.demand_blocks:7.0f} "
                f"{r.signal_desired:6.0f} {r.hpa_desired:3d} {r.waiting_jobs:7.0f} {r.running_jobs:7.0f} "
                f"{r.num_submitted:5d} {r.num_done:5d} {_fmt(r.queue_wait_p50_s):>9} "
                f"{_fmt(r.queue_wait_p99_s):>9}"
            )
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        jobs = []
        for job_id, (burst, submitted_s) in self.submitted.items():
            result = self.results.get(job_id)
            jobs.append(
                {
                    "id": job_id,
                    "burst": burst,
                    "submitted_s": round(submitted_s, 3),
                    "status": result.status.value if result else None,
                    "attempts": result.attempts if result else None,
                    "worker": result.worker if result else None,
                    "queue_wait_s": self.queue_wait_s(result) if result else None,
                }
            )
        return {
            "config": {
                "bursts": [asdict(b) for b in self.config.bursts],
                "policy": asdict(self.config.policy),
                "sizing": asdict(self.config.sizing),
                "worker_args": list(self.config.worker_args),
                "poll_interval_s": self.config.poll_interval_s,
                "max_processes": self.config.max_processes,
                "victim": self.config.victim.value,
            },
            "summary": self.summary(),
            "burst_started_s": self.burst_started_s,
            "timeline": [asdict(row) for row in self.rows],
            "workers": self.workers,
            "jobs": jobs,
            "notes": self.notes,
        }


def _percentiles(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None, "max": None}
    arr = np.asarray(values, dtype=np.float64)
    return {
        "p50": round(float(np.percentile(arr, 50)), 3),
        "p99": round(float(np.percentile(arr, 99)), 3),
        "max": round(float(arr.max()), 3),
    }


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def plan_jobs(bursts: Sequence[Burst], seed: int) -> dict[str, list[PlannedJob]]:
    """Each burst's jobs with their offsets. Prompts are token ids (the signal then sizes them
    exactly); ignore_eos makes each job generate all its max_tokens."""
    rng = random.Random(seed)
    planned: dict[str, list[PlannedJob]] = {}
    for burst in bursts:
        if burst.name in planned:
            raise ValueError(f"two bursts are named {burst.name!r}")
        if burst.after is not None and burst.after not in planned:
            raise ValueError(f"burst {burst.name!r} comes after {burst.after!r}, which is not before it")
        jobs = planned[burst.name] = []
        for i in range(burst.num_jobs):
            num_prompt_tokens = rng.randint(*burst.prompt_tokens)
            job = {
                "prompt_token_ids": [rng.randrange(100, 40_000) for _ in range(num_prompt_tokens)],
                "params": {
                    "max_tokens": rng.randint(*burst.max_tokens),
                    "ignore_eos": True,
                    "temperature": 0.0,
                },
                "metadata": {"burst": burst.name},
            }
            jobs.append(PlannedJob(burst.spread_s * i / burst.num_jobs, burst.name, job))
    return planned


class _Submitter(threading.Thread):
    """Plays the bursts in order: waits for each one's start, then puts its jobs on the queue at
    their offsets (in groups of what is due)."""

    def __init__(
        self,
        queue_url: str,
        bursts: Sequence[Burst],
        planned: dict[str, list[PlannedJob]],
        t0: float,
        count_done: Callable[[list[str]], int],
    ) -> None:
        super().__init__(name="pool-scenario-submitter", daemon=True)
        self.queue_url = queue_url
        self.bursts = bursts
        self.planned = planned
        self.t0 = t0
        self.count_done = count_done
        self.submitted: dict[str, tuple[str, float]] = {}
        # Burst name -> its start, seconds since t0.
        self.started_s: dict[str, float] = {}
        self.error: BaseException | None = None
        self.lock = threading.Lock()
        # Set by the run when it ends early (a timeout, an error): submit nothing more.
        self.stop = threading.Event()

    def _start_of(self, burst: Burst, ids_by_burst: dict[str, list[str]]) -> float | None:
        """When the burst starts (seconds since t0), or None when the run stopped first."""
        if burst.after is None:
            return burst.at_s
        ids = ids_by_burst[burst.after]
        needed = burst.after_done_fraction * len(ids)
        while self.count_done(ids) < needed:
            if self.stop.wait(0.1):
                return None
        return time.monotonic() - self.t0 + burst.at_s

    def run(self) -> None:
        from qworker.jobs.client import Client

        ids_by_burst: dict[str, list[str]] = {}
        try:
            with Client(queue=self.queue_url) as client:
                for burst in self.bursts:
                    start_s = self._start_of(burst, ids_by_burst)
                    if start_s is None:
                        return
                    self.started_s[burst.name] = start_s
                    jobs = self.planned[burst.name]
                    ids_by_burst[burst.name] = []
                    i = 0
                    while i < len(jobs):
                        wait_s = start_s + jobs[i].offset_s - (time.monotonic() - self.t0)
                        if wait_s > 0 and self.stop.wait(wait_s):
                            return
                        now_s = time.monotonic() - self.t0
                        due = []
                        while i < len(jobs) and start_s + jobs[i].offset_s <= now_s:
                            due.append(jobs[i])
                            i += 1
                        ids = client.submit_many([p.job for p in due])
                        ids_by_burst[burst.name] += ids
                        submitted_s = time.monotonic() - self.t0
                        with self.lock:
                            for job_id in ids:
                                self.submitted[job_id] = (burst.name, submitted_s)
        except BaseException as exc:  # re-raised by run_scenario
            self.error = exc

    def snapshot(self) -> dict[str, tuple[str, float]]:
        with self.lock:
            return dict(self.submitted)


def _read_signal(url: str) -> dict[str, float]:
    """The exporter's qworker_pool_* gauges, read as KEDA's metrics-api scaler reads them."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=2) as response:
        text = response.read().decode()
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("qworker_pool_")
    }


class _Exporter:
    """run_metrics_exporter (the `qworker metrics-exporter` loop) in a thread on a free port."""

    def __init__(self, queue_url: str, sizing: PoolSizing, interval_s: float) -> None:
        self.stop = threading.Event()
        self.serving: list[Any] = []
        self.thread = threading.Thread(
            target=run_metrics_exporter,
            args=(queue_url, sizing),
            kwargs={
                "host": "127.0.0.1",
                "port": 0,
                "interval_s": interval_s,
                "stop": self.stop,
                "on_serving": self.serving.append,
            },
            name="pool-scenario-exporter",
            daemon=True,
        )

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.serving:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the metrics exporter did not start")
            time.sleep(0.02)
        base = f"http://127.0.0.1:{self.serving[0].port}"
        while True:  # one reading done: the gauges hold a value
            try:
                with urllib.request.urlopen(f"{base}/readyz", timeout=1) as response:
                    if response.status == 200:
                        return f"{base}/metrics"
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the metrics exporter never read the queue")
            time.sleep(0.05)

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=10)


def _started_waits(results: dict[str, JobResult], started_wall: float) -> list[tuple[float, float]]:
    """(start time in seconds since the run began, queue wait) of every job that started."""
    out = []
    for r in results.values():
        t = r.timings
        if t.started_at is not None and t.enqueued_at is not None:
            out.append((t.started_at - started_wall, t.started_at - t.enqueued_at))
    return out


def run_scenario(queue_url: str, model: str, config: ScenarioConfig, log_dir: Path) -> ScenarioRun:
    """Play the bursts against an autoscaled pool and return what happened. The pool starts and
    ends at 0 replicas; every process is stopped before this returns, even on an error."""
    planned = plan_jobs(config.bursts, config.seed)
    num_jobs = sum(len(jobs) for jobs in planned.values())
    parsed = parse_url(queue_url, SOURCE_PARAMS | SINK_PARAMS)
    prefix = parsed.params.get("prefix", constants.DEFAULT_RESULT_PREFIX)
    redis = redis_client(parsed.connection_url)
    lock = threading.Lock()

    def count_done(ids: list[str]) -> int:
        """Jobs among `ids` with a stored result (the submitter's thread and this one share it)."""
        num_done = 0
        with lock:
            for i in range(0, len(ids), 500):
                num_done += int(redis.exists(*[constants.result_key(prefix, j) for j in ids[i : i + 500]]))
        return num_done

    autoscaler = Autoscaler(config.policy)
    rows: list[TimelineRow] = []
    is_timed_out = False
    with _Exporter(queue_url, config.sizing, config.exporter_interval_s) as metrics_url:
        t0 = time.monotonic()
        started_wall = time.time()
        pool = WorkerPool(
            queue_url,
            model,
            config.worker_args,
            log_dir,
            max_processes=config.max_processes,
            victim=config.victim,
            num_threads=config.num_threads,
            started_at=t0,
        )
        submitter = _Submitter(queue_url, config.bursts, planned, t0, count_done)
        submitter.start()
        try:
            poll = 0
            num_idle_polls = 0
            while True:
                poll += 1
                next_at = t0 + poll * config.poll_interval_s
                time.sleep(max(0.0, next_at - time.monotonic()))
                now_s = time.monotonic() - t0
                signal = _read_signal(metrics_url)
                pool.poll()
                demand = signal.get("qworker_pool_demand_blocks", 0.0)
                decision = autoscaler.decide(now_s, demand, pool.replicas)
                pool.set_replicas(decision.replicas)
                submitted = submitter.snapshot()
                num_done = count_done(list(submitted)) if submitted else 0
                rows.append(
                    TimelineRow(
                        t_s=round(now_s, 2),
                        replicas=pool.replicas,
                        num_ready=pool.num_ready,
                        num_starting=pool.num_starting,
                        num_draining=pool.num_draining,
                        demand_blocks=demand,
                        signal_desired=signal.get("qworker_pool_desired_workers", 0.0),
                        hpa_desired=decision.desired,
                        waiting_jobs=signal.get("qworker_pool_waiting_jobs", 0.0),
                        running_jobs=signal.get("qworker_pool_running_jobs", 0.0),
                        num_submitted=len(submitted),
                        num_done=num_done,
                    )
                )
                if submitter.error is not None:
                    raise submitter.error
                is_idle = (
                    not submitter.is_alive() and pool.replicas == 0 and pool.num_alive == 0 and demand == 0
                )
                num_idle_polls = num_idle_polls + 1 if is_idle else 0
                # Done: every result is in and the pool is back at 0. A pool at 0 with no demand
                # for a few polls while results are missing has lost them: end, and let the
                # caller's checks say so.
                if is_idle and (num_done == num_jobs or num_idle_polls >= LOST_WORK_POLLS):
                    break
                if now_s > config.timeout_s:
                    is_timed_out = True
                    break
        finally:
            submitter.stop.set()
            pool.close()
            submitter.join(timeout=10)
    submitted = submitter.snapshot()
    results: dict[str, JobResult] = {}
    ids = list(submitted)
    for i in range(0, len(ids), 500):
        raws = redis.mget([constants.result_key(prefix, j) for j in ids[i : i + 500]])
        for job_id, raw in zip(ids[i : i + 500], raws, strict=True):
            if raw is not None:
                results[job_id] = JobResult.model_validate_json(raw)
    num_result_keys = sum(1 for _ in redis.scan_iter(match=constants.result_key(prefix, "*"), count=1000))
    redis.close()

    starts = _started_waits(results, started_wall)
    previous_t = float("-inf")
    for row in rows:
        waits = [w for t, w in starts if previous_t < t <= row.t_s]
        row.num_started = len(waits)
        if waits:
            p = _percentiles(waits)
            row.queue_wait_p50_s, row.queue_wait_p99_s = p["p50"], p["p99"]
        previous_t = row.t_s
    return ScenarioRun(
        config=config,
        rows=rows,
        submitted=submitted,
        results=results,
        num_result_keys=num_result_keys,
        workers=[w.summary() for w in pool.workers],
        is_timed_out=is_timed_out,
        burst_started_s=dict(submitter.started_s),
        started_wall=started_wall,
    )


def write_timeline_json(run: ScenarioRun, path: Path) -> None:
    path.write_text(json.dumps(run.to_json(), indent=1) + "\n")


def plot_timeline(payload: dict[str, Any], path: Path, title: str) -> None:
    """Three panels over time, from a run's JSON (ScenarioRun.to_json): replicas (asked, ready)
    with the HPA's and the signal's desired counts; KV demand against what the replicas serve at
    the target value; job arrivals, queue depth, running jobs and the queue wait p99. Phase starts
    are marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = payload["timeline"]
    policy = payload["config"]["policy"]
    poll_s = payload["config"]["poll_interval_s"]
    ts = [r["t_s"] for r in rows]

    def series(key: str) -> list[Any]:
        return [r[key] for r in rows]

    fig, (ax_rep, ax_dem, ax_q) = plt.subplots(3, 1, figsize=(11, 8.5), sharex=True)
    ax_rep.step(ts, series("replicas"), where="post", label="replicas (asked)", linewidth=2)
    ax_rep.step(ts, series("num_ready"), where="post", label="ready (/readyz 200)", linestyle="--")
    ax_rep.step(ts, series("hpa_desired"), where="post", label="HPA desired (bounded)", linestyle=":")
    ax_rep.step(ts, series("signal_desired"), where="post", label="signal: desired workers", alpha=0.4)
    ax_rep.set_ylim(-0.2, policy["max_replicas"] + 1.6)
    ax_rep.set_ylabel("workers")
    ax_rep.legend(loc="upper right", fontsize=8, ncol=4)

    target = policy["target_value"]
    ax_dem.plot(ts, series("demand_blocks"), label="demand (qworker_pool_demand_blocks)", color="tab:red")
    ax_dem.step(
        ts,
        [n * target for n in series("replicas")],
        where="post",
        label="replicas x target value",
        color="tab:blue",
    )
    ax_dem.axhline(target, color="gray", linestyle=":", linewidth=1, label=f"target value {target:g}")
    ax_dem.set_ylabel("KV blocks")
    ax_dem.legend(loc="upper right", fontsize=8)

    arrivals = [job["submitted_s"] for job in payload["jobs"]]
    bins = np.arange(0.0, (ts[-1] if ts else 1.0) + poll_s, poll_s)
    ax_q.hist(arrivals, bins=bins, color="lightgray", label="jobs arriving (per poll)")
    ax_q.plot(ts, series("waiting_jobs"), label="waiting jobs (queue depth)", color="tab:purple")
    ax_q.plot(ts, series("running_jobs"), label="running jobs", color="tab:green")
    ax_q.set_ylabel("jobs")
    ax_q.set_xlabel("seconds")
    ax_wait = ax_q.twinx()
    waits = [(r["t_s"], r["queue_wait_p99_s"]) for r in rows if r["queue_wait_p99_s"] is not None]
    ax_wait.plot([t for t, _ in waits], [w for _, w in waits], "k.", markersize=3, label="queue wait p99 (s)")
    ax_wait.set_ylabel("queue wait p99 of the jobs starting, s")
    handles, labels = ax_q.get_legend_handles_labels()
    more_handles, more_labels = ax_wait.get_legend_handles_labels()
    ax_q.legend(handles + more_handles, labels + more_labels, loc="upper right", fontsize=8)

    for name, start_s in payload.get("burst_started_s", {}).items():
        for ax in (ax_rep, ax_dem, ax_q):
            ax.axvline(start_s, color="black", linewidth=0.5, alpha=0.3)
        ax_rep.annotate(name, (start_s + 0.5, policy["max_replicas"] + 0.3), fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def bursty_config(
    *,
    num_cycles: int = 1,
    num_kv_blocks: int = 512,
    max_replicas: int = 2,
    victim: Victim = Victim.BUSIEST,
    drain_grace_s: float = 0.5,
    seed: int = 0,
) -> ScenarioConfig:
    """The pool test's scenario, for a tiny model (1024 positions) on a 2-core machine. Each of
    `num_cycles` cycles has:

    - a burst: 160 short jobs (about 5 blocks each, 750 in all: the signal asks for 2 workers);
    - from when 90% of the burst is done, a trickle of longer jobs, one a second for 25 s (700-960
      new tokens, about 60 blocks, two to four seconds each, so that two or more are in flight at
      any moment even on a quiet machine; with 300-500 tokens a quiet machine sometimes had none
      in flight on the removed worker when the scale-in came): demand is far below one worker's
      target, so the HPA scales in during the burst's tail or the trickle, while jobs are in
      flight; with a drain grace shorter than what is left of them, the removed worker releases
      them and its peer runs them again;
    - a quiet gap: the next phase starts 20 s after 90% of the trickle is done, long after its
      last job and the cooldown: the pool goes to 0.

    Then a last burst of 120 short jobs arrives, from 0 workers again, and the pool ends at 0.
    KEDA's and the HPA's windows are keda-kv-demand.yaml's minutes scaled down to seconds
    (cooldown 5 s, scale-down stabilisation 5 s, a poll per second).
    """
    short, long = ((8, 48), (16, 64)), ((16, 32), (700, 960))
    bursts: list[Burst] = []
    previous: str | None = None
    for c in range(1, num_cycles + 1):
        # After 90% (not all) of a phase: a job lost by a broken drain must not stall the run.
        at_s = 1.0 if previous is None else 20.0
        bursts.append(Burst(f"burst-{c}", at_s, 160, 1.0, *short, after=previous, after_done_fraction=0.9))
        bursts.append(
            Burst(f"trickle-{c}", 0.0, 25, 25.0, *long, after=f"burst-{c}", after_done_fraction=0.9)
        )
        previous = f"trickle-{c}"
    bursts.append(Burst("last-burst", 20.0, 120, 1.0, *short, after=previous, after_done_fraction=0.9))
    sizing = PoolSizing(capacity_blocks=num_kv_blocks, block_size=16, target_utilization=0.8)
    policy = ScalingPolicy(
        target_value=num_kv_blocks * sizing.target_utilization,
        max_replicas=max_replicas,
        cooldown_s=5.0,
        scale_down_window_s=5.0,
    )
    worker_args = (
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--num-kv-blocks",
        str(num_kv_blocks),
        "--block-size",
        str(sizing.block_size),
        "--max-num-seqs",
        "8",
        "--drain-grace-s",
        str(drain_grace_s),
    )
    return ScenarioConfig(
        bursts=tuple(bursts),
        policy=policy,
        sizing=sizing,
        worker_args=worker_args,
        max_processes=max_replicas,
        victim=victim,
        seed=seed,
        timeout_s=120.0 * (num_cycles + 1),
    )
