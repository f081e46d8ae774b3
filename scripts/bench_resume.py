"""Resume from tokens, measured end to end (issue 38; docs/BENCHMARKS.md "Resume from tokens: a
drained worker's jobs on a peer"): what a worker SIGTERMed half way through its jobs costs the
pool when a peer resumes them from their delta streams, against an uninterrupted run and against
restarting them from zero.

On a private redis-server on a free loopback port (never 127.0.0.1:6379), SmolLM2 (`smollm2`),
`--num-jobs` chat jobs of `--max-tokens` greedy tokens each (ignore_eos), every worker with
`--batch-invariant` (so that a resumed greedy job can end with exactly an uninterrupted run's
token ids), run three ways one after the other, each on fresh worker processes (no prefix cache
carried from one way to the next):

  (a) uninterrupted: one worker takes every job and finishes them;
  (b) resume: worker A takes every job; once every job's delta stream holds `--cut` of its tokens,
      A is SIGTERMed (`--drain-grace-s`); it flushes its outbox and releases the jobs that cannot
      finish within the grace, and exits. Worker B is then started and takes them: it resumes each
      from the tokens its stream holds;
  (c) restart: the same, but the jobs' delta streams are deleted after A has exited and before B
      starts, so that B finds no stored tokens and restarts each job from zero. qworker has no
      switch to turn resume off (a redelivered job always reads its stream), and this is what a
      peer without stored tokens does (a results store that keeps no deltas, an expired stream).

B is started once A has exited, in (b) as in (c): (c) needs the streams deleted while no worker
can take the released jobs, and the same timing in (b) keeps the two ways' end-to-end times
comparable. B's time to ready is reported, so that a reader can take it off for a peer that was
already running.

Tokens computed pool-wide = per worker, prompt tokens prefilled (qworker_prompt_tokens_total) +
resumed tokens prefilled again (qworker_resumed_tokens_total) + tokens generated
(qworker_generation_tokens_total), from each worker's /metrics. A worker that drained is gone by
the time its last step is counted, so its generated tokens are read from the delta streams
instead (the drain flushes every generated token before it releases; its last scrape of
/metrics is printed beside, as a check). Also reported: prefill and generated (decode) tokens
apart, each worker's CPU seconds after ready (os.wait4), the slowest job's end-to-end time
(submit to the result's finished_at, one clock), the tokens each job delivered (len(token_ids)
and usage.completion_tokens) and whether its ids equal way (a)'s.

    .venv/bin/python scripts/bench_resume.py [--num-jobs 8] [--max-tokens 2048] [--cut 0.5]
        [--drain-grace-s 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

import redis

from qworker.backends.redis.server import RedisServer, free_port
from qworker.jobs.client import Client
from qworker.jobs.job import JobResult, JobStatus
from qworker.testing.worker_kit import unique_url

TOPICS = (
    "the sea",
    "a mountain village",
    "the history of clocks",
    "how bread is made",
    "a journey by train",
    "the life of bees",
    "a city at night",
    "the first winter snow",
    "an old lighthouse",
    "a desert at noon",
    "the invention of paper",
    "a river delta",
)
METRICS = {
    "prompt": "qworker_prompt_tokens_total",
    "resumed": "qworker_resumed_tokens_total",
    "generated": "qworker_generation_tokens_total",
    "steps": "qworker_engine_steps_total",
}
CLK_TCK = os.sysconf("SC_CLK_TCK")


def job_bodies(num_jobs: int, max_tokens: int) -> list[dict]:
    return [
        {
            "messages": [
                {"role": "user", "content": f"Write a long, detailed essay about {TOPICS[i % len(TOPICS)]}."}
            ],
            "params": {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True},
        }
        for i in range(num_jobs)
    ]


def cpu_seconds(pid: int) -> float:
    """utime + stime of a live process, all its threads (/proc/pid/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
        text = response.read().decode()
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        for key, metric in METRICS.items():
            if name == metric:
                values[key] = float(value)
    return values


@dataclass
class Worker:
    """One `qworker worker` process, its /metrics port and its CPU time."""

    name: str
    process: subprocess.Popen
    port: int
    log_path: Path
    ready_s: float  # from start to its ready line
    cpu_at_ready: float
    cpu_after_ready: float | None = None
    last_metrics: dict[str, float] = field(default_factory=dict)
    _watch: threading.Thread | None = None

    @classmethod
    def start(cls, url: str, name: str, args: argparse.Namespace, tmp: Path) -> Worker:
        port = free_port()
        log_path = tmp / f"{name}.log"
        log = open(log_path, "w")  # noqa: SIM115 - the process owns it
        started = time.monotonic()
        command = [sys.executable, "-m", "qworker.cli", "worker", "--queue", url, "--name", name]
        command += ["--model", args.model, "--device", "cpu", "--dtype", args.dtype, "--batch-invariant"]
        command += ["--drain-grace-s", str(args.drain_grace_s), "--metrics-port", str(port)]
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
        )
        while f"worker {name} ready" not in log_path.read_text():
            if process.poll() is not None or time.monotonic() - started > 300:
                process.kill()
                raise RuntimeError(f"worker {name} did not start:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.05)
        worker = cls(name, process, port, log_path, time.monotonic() - started, cpu_seconds(process.pid))
        worker._watch = threading.Thread(target=worker._scrape_until_exit, daemon=True)
        worker._watch.start()
        return worker

    def _scrape_until_exit(self) -> None:
        while self.process.returncode is None:
            with contextlib.suppress(OSError):  # not serving yet, or gone
                self.last_metrics = scrape(self.port)
            time.sleep(0.1)

    def metrics(self) -> dict[str, float]:
        self.last_metrics = scrape(self.port)
        return self.last_metrics

    def stop(self, sig: signal.Signals = signal.SIGTERM, timeout_s: float = 120) -> int:
        """Signal it and reap it (os.wait4: its CPU time, every thread's, up to its exit)."""
        self.process.send_signal(sig)
        deadline = time.monotonic() + timeout_s
        while True:
            pid, status, usage = os.wait4(self.process.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                os.killpg(self.process.pid, signal.SIGKILL)
                raise TimeoutError(f"worker {self.name} did not exit within {timeout_s}s")
            time.sleep(0.02)
        self.process.returncode = os.waitstatus_to_exitcode(status)
        self.cpu_after_ready = usage.ru_utime + usage.ru_stime - self.cpu_at_ready
        return self.process.returncode

    def log(self) -> str:
        return self.log_path.read_text()


def stored_tokens(r: redis.Redis, key: str) -> int:
    """The tokens a job's delta stream holds, contiguous from 0 (its last delta's pos + length)."""
    for _, fields in r.xrevrange(key, "+", "-", count=5):
        if b"pos" in fields and b"token_ids" in fields:
            return int(fields[b"pos"]) + len(json.loads(fields[b"token_ids"]))
    return 0


@dataclass
class WayResult:
    way: str
    prefill_tokens: int = 0
    generated_tokens: int = 0
    cpu_s: float = 0.0
    slowest_e2e_s: float = 0.0
    delivered: list[int] = field(default_factory=list)
    usage_completion: list[int] = field(default_factory=list)
    attempts: list[int] = field(default_factory=list)
    ids_equal: bool | None = None
    wall_s: float = 0.0
    notes: dict = field(default_factory=dict)

    @property
    def computed(self) -> int:
        return self.prefill_tokens + self.generated_tokens


def finish_way(
    out: WayResult, results: list[JobResult], submitted_at: float, reference: list[JobResult] | None
) -> None:
    for result in results:
        assert result.status is JobStatus.COMPLETED, result
    out.slowest_e2e_s = max(r.timings.finished_at - submitted_at for r in results)
    out.delivered = [len(r.token_ids) for r in results]
    out.usage_completion = [r.usage.completion_tokens for r in results]
    out.attempts = [r.attempts for r in results]
    if reference is not None:
        out.ids_equal = all(r.token_ids == ref.token_ids for r, ref in zip(results, reference, strict=True))


def add_worker_tokens(out: WayResult, values: dict[str, float], worker: Worker) -> None:
    out.prefill_tokens += int(values.get("prompt", 0) + values.get("resumed", 0))
    out.generated_tokens += int(values.get("generated", 0))
    out.cpu_s += worker.cpu_after_ready or 0.0


def run_uninterrupted(
    server_url: str, args: argparse.Namespace, tmp: Path
) -> tuple[WayResult, list[JobResult]]:
    url = unique_url(server_url, tag="resume-a")
    out = WayResult("(a) uninterrupted")
    worker = Worker.start(url, "a", args, tmp)
    client = Client(queue=url)
    try:
        started = time.monotonic()
        submitted_at = time.time()
        ids = client.submit_many(job_bodies(args.num_jobs, args.max_tokens))
        results = client.results(ids, timeout=3600)
        out.wall_s = time.monotonic() - started
        values = worker.metrics()
        assert worker.stop() == 0
        add_worker_tokens(out, values, worker)
        finish_way(out, results, submitted_at, None)
        out.notes = {"worker_ready_s": round(worker.ready_s, 1), "steps": values.get("steps")}
        return out, results
    finally:
        client.close()
        if worker.process.returncode is None:
            os.killpg(worker.process.pid, signal.SIGKILL)


def run_interrupted(
    server_url: str, args: argparse.Namespace, tmp: Path, reference: list[JobResult], *, resume: bool
) -> WayResult:
    tag = "b" if resume else "c"
    url = unique_url(server_url, tag=f"resume-{tag}")
    out = WayResult("(b) SIGTERM, B resumes" if resume else "(c) SIGTERM, B restarts from zero")
    client = Client(queue=url)
    r = client.sink.redis
    cut_tokens = round(args.cut * args.max_tokens)
    workers: list[Worker] = []
    try:
        a = Worker.start(url, f"{tag}A", args, tmp)
        workers.append(a)
        started = time.monotonic()
        submitted_at = time.time()
        ids = client.submit_many(job_bodies(args.num_jobs, args.max_tokens))
        delta_keys = [client.sink.delta_key(job_id) for job_id in ids]
        while min(stored_tokens(r, key) for key in delta_keys) < cut_tokens:
            if a.process.poll() is not None:
                raise RuntimeError(f"worker A exited:\n{a.log()[-3000:]}")
            time.sleep(0.05)
        a_prompt = a.metrics().get("prompt", 0)
        at_signal = [stored_tokens(r, key) for key in delta_keys]
        sigterm_at = time.time()
        assert a.stop() == 0, a.log()[-3000:]
        a_exited_at = time.time()
        assert not any(client.sink.has_result(job_id) for job_id in ids), "A must stop mid-generation"
        assert f"released {args.num_jobs} jobs" in a.log(), a.log()[-3000:]
        # What A generated: every token it computed is in the streams (the drain flushes first).
        by_a = [len(client.sink.read_progress(job_id).token_ids) for job_id in ids]
        out.prefill_tokens += int(a_prompt)
        out.generated_tokens += sum(by_a)
        out.cpu_s += a.cpu_after_ready or 0.0
        if not resume:
            r.delete(*delta_keys)
        b = Worker.start(url, f"{tag}B", args, tmp)
        workers.append(b)
        results = client.results(ids, timeout=3600)
        out.wall_s = time.monotonic() - started
        values = b.metrics()
        assert b.stop() == 0
        add_worker_tokens(out, values, b)
        finish_way(out, results, submitted_at, reference)
        log_b = b.log()
        num_resumed_logged = sum(f"job {job_id} resumes from " in log_b for job_id in ids)
        assert num_resumed_logged == (args.num_jobs if resume else 0), num_resumed_logged
        out.notes = {
            "tokens_stored_at_sigterm": [min(at_signal), max(at_signal)],
            "tokens_by_A": [min(by_a), max(by_a)],
            "A_generated_last_scrape": a.last_metrics.get("generated"),
            "A_exit_after_sigterm_s": round(a_exited_at - sigterm_at, 2),
            "B_ready_s": round(b.ready_s, 1),
            "B_prompt": values.get("prompt"),
            "B_resumed": values.get("resumed"),
            "B_generated": values.get("generated"),
            "A_cpu_after_ready_s": round(a.cpu_after_ready or 0.0, 1),
            "B_cpu_after_ready_s": round(b.cpu_after_ready or 0.0, 1),
        }
        return out
    finally:
        client.close()
        for worker in workers:
            if worker.process.returncode is None:
                os.killpg(worker.process.pid, signal.SIGKILL)


def table(ways: list[WayResult], args: argparse.Namespace) -> str:
    base = ways[0]
    rows = [
        "| way | tokens computed (prefill + generated) | ratio to (a) | generated only, ratio | "
        "worker CPU s after ready, ratio | slowest job's e2e | tokens delivered (usage) | ids equal (a) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for w in ways:
        delivered = sorted(set(w.delivered))
        usage = sorted(set(w.usage_completion))
        rows.append(
            f"| {w.way} | {w.computed:,} ({w.prefill_tokens:,} + {w.generated_tokens:,}) "
            f"| {w.computed / base.computed:.2f}x | {w.generated_tokens / base.generated_tokens:.2f}x "
            f"| {w.cpu_s:.0f} s, {w.cpu_s / base.cpu_s:.2f}x | {w.slowest_e2e_s:.1f} s "
            f"| {args.num_jobs} x {','.join(map(str, delivered))} ({','.join(map(str, usage))}) "
            f"| {'-' if w.ids_equal is None else ('yes' if w.ids_equal else 'NO')} |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-jobs", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=2048)
    parser.add_argument("--cut", type=float, default=0.5, help="SIGTERM once each job has this share")
    parser.add_argument("--drain-grace-s", type=float, default=5.0)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--ways", default="abc", help="which ways to run after (a): b, c or both")
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="bench-resume-"))
    server = RedisServer(tmp / "redis", appendonly=False).start()
    began = time.monotonic()
    try:
        size = f"{args.num_jobs} jobs x {args.max_tokens} tokens, cut at {args.cut}"
        print(f"redis-server on {server.url}; {size}")
        a, reference = run_uninterrupted(server.url, args, tmp)
        print(f"(a) done in {a.wall_s:.0f}s: {a.notes}", flush=True)
        ways = [a]
        for resume in (True, False):
            if ("b" if resume else "c") not in args.ways:
                continue
            way = run_interrupted(server.url, args, tmp, reference, resume=resume)
            print(f"{way.way} done in {way.wall_s:.0f}s: {way.notes}", flush=True)
            ways.append(way)
        print()
        print(table(ways, args))
        print(f"\nwhole script: {time.monotonic() - began:.0f}s")
        if args.json is not None:
            args.json.write_text(json.dumps([asdict(w) | {"computed": w.computed} for w in ways], indent=1))
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
