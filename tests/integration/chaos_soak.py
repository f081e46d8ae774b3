"""Chaos soak: worker processes on a private Redis (AOF on) serve short jobs while a chaos loop
SIGKILLs a worker (restarted a few seconds later), SIGTERMs one (restarted once it has drained)
and restarts Redis once. A producer submits at a steady rate with bursts.

At the end it counts, over the job ids it submitted:
- results: jobs with a stored result (expected: all of them); lost: the others;
- duplicated: jobs that ran to completion more than once (more than one done marker on their
  delta stream: every completed attempt writes one, stored or not);
- pending: entries still pending in the consumer group, plus entries left in the stream, over the
  stream and its priority lane (a tenth of the jobs are urgent and go through the lane);
- dead letters: entries in the dead-letter stream (none expected: every job is valid).
Memory: every 10 s the RSS of each worker process and Redis's used_memory, plotted to
memory.png. Growth after warm-up is bounded:
- a worker process: the median of its last three RSS samples at most 96 MiB above the median
  of its first three after its warm-up (the model and KV cache are allocated up front; RSS moves
  by some 60 MiB from sample to sample as the allocator takes and returns memory, which the
  medians smooth; a leak of a few KiB per job over 10,000 jobs exceeds the bound);
- Redis: used_memory may grow by the results it keeps (each is stored for its TTL), at most
  REDIS_BYTES_PER_JOB per job plus 32 MiB.
With `cluster` (scripts/chaos_soak.py --cluster) the same soak runs on a private 3-primary Redis
Cluster (AOF on every node) with the cluster key layout: the Redis event is the restart of the
node that serves the queue's slot, and once, at 70% of the run, the queue's slot migrates to
another node while the workers lease from it.
With `affinity_lanes` (e.g. `--affinity-lanes 8 --affinity-keys 20`) the queue has that many
affinity lanes, two jobs in three name one of the keys and the rest none (the shared stream), and
the pending count covers every lane.
`run_soak` prints the counts and returns 1 if any is wrong. scripts/chaos_soak.py runs it from
the command line (10,000 jobs, about 20 minutes); tests/integration/test_chaos_small.py runs that
script with 300.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis as redis_lib

from qworker.backends.redis import keys as constants
from qworker.backends.redis.lanes import QueueStreams
from qworker.backends.redis.server import RedisServer
from qworker.backends.redis.topologies import LocalCluster, RedisNode
from qworker.jobs.client import Client
from qworker.testing.worker_kit import spawn_worker, write_tiny_model_dir

MIB = 1024 * 1024
WORKER_GROWTH_BOUND_BYTES = 96 * MIB
REDIS_BYTES_PER_JOB = 8 * 1024
REDIS_GROWTH_SLACK_BYTES = 32 * MIB


@dataclass
class Slot:
    """One worker place: its current process (restarted after chaos) and its history."""

    name: str
    process: subprocess.Popen | None = None
    generation: int = 0
    # (seconds since start, pid, rss bytes)
    samples: list[tuple[float, int, int]] = field(default_factory=list)
    started_at: dict[int, float] = field(default_factory=dict)


@dataclass(frozen=True)
class SoakSettings:
    """A soak's size and pace; scripts/chaos_soak.py makes one flag of each field."""

    num_jobs: int = 10_000
    workers: int = 2
    rate: float = field(default=9.0, metadata={"help": "jobs per second between bursts"})
    burst_every_s: float = 60.0
    burst_size: int = 200
    chaos_every_s: float = field(default=45.0, metadata={"help": "mean seconds between chaos actions"})
    urgent_share: float = field(
        default=0.1, metadata={"help": "share of jobs sent through the priority lane"}
    )
    lease_timeout_s: float = 5.0
    sample_every_s: float = 10.0
    warmup_s: float = 60.0
    timeout_s: float = 3600.0
    seed: int = 0
    out: str = str(Path(tempfile.gettempdir()) / "qworker-chaos-soak")
    model_dir: str = str(Path(tempfile.gettempdir()) / "qworker-chaos-tiny-llama")
    cluster: bool = field(default=False, metadata={"help": "run on a 3-primary Redis Cluster"})
    affinity_lanes: int = field(default=1, metadata={"help": "the queue's affinity_lanes (1: none)"})
    affinity_keys: int = field(
        default=0,
        metadata={"help": "distinct affinity keys; two jobs in three name one of them, the rest none"},
    )


class ClusterStore:
    """The soak's Redis when it is a cluster: the node that serves the queue's slot stands for
    the server (killed and restarted once), and counts go through a cluster client."""

    def __init__(self, data_dir: Path, stream_key: str) -> None:
        from redis.crc import key_slot

        self.cluster = LocalCluster(data_dir)
        for node in self.cluster.nodes:
            node.args += ["--appendonly", "yes", "--appendfsync", "everysec"]
        self.cluster.start()
        self.slot = key_slot(stream_key.encode())
        # The node kill() took down, for start() to bring back.
        self.killed: RedisNode | None = None

    @property
    def url(self) -> str:
        return self.cluster.url

    def queue_node(self) -> RedisNode:
        return self.cluster.owner_of(self.slot)

    def kill(self) -> None:
        self.killed = self.queue_node()
        self.killed.kill()

    def start(self) -> None:
        assert self.killed is not None, "kill() first"
        self.killed.start()

    def stop(self) -> None:
        self.cluster.stop()

    def used_memory(self) -> int:
        return sum(int(node.client().info("memory")["used_memory"]) for node in self.cluster.nodes)

    def client(self) -> Any:
        return redis_lib.RedisCluster(
            host="127.0.0.1",
            port=self.cluster.nodes[0].port,
            socket_timeout=10,
            cluster_error_retry_attempts=10,
        )


class Soak:
    def __init__(self, settings: SoakSettings) -> None:
        self.settings = settings
        self.rng = random.Random(settings.seed)
        self.out = Path(settings.out)
        self.out.mkdir(parents=True, exist_ok=True)
        name = f"soak:{os.getpid()}"
        self.layout = constants.CLUSTER if settings.cluster else constants.SINGLE_SERVER
        self.stream = self.layout.stream(name)
        self.prefix = name
        self.server: RedisServer | ClusterStore
        if settings.cluster:
            self.server = ClusterStore(self.out / "redis-cluster", self.stream)
        else:
            self.server = RedisServer(self.out / "redis-data").start()
        self.url = f"{self.server.url}?stream={name}&group=g&prefix={name}"
        if settings.affinity_lanes != 1:
            self.url += f"&affinity_lanes={settings.affinity_lanes}"
        self.streams = QueueStreams.of(self.stream, settings.affinity_lanes, cluster=settings.cluster)
        self.num_slot_moves = 0
        self.model_dir = write_tiny_model_dir(Path(settings.model_dir))
        self.slots = [Slot(f"w{i}") for i in range(settings.workers)]
        self.t0 = time.monotonic()
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.submitted: list[str] = []
        self.redis_samples: list[tuple[float, int]] = []
        self.events: list[tuple[float, str]] = []
        self.num_kills = 0
        self.num_terms = 0
        self.num_redis_restarts = 0
        # Restarts under way (each waits until its worker is ready): joined before the run returns,
        # so that a worker still starting when the run stops is stopped too, not left behind.
        self.restarts: list[threading.Thread] = []

    def now(self) -> float:
        return time.monotonic() - self.t0

    def log(self, text: str) -> None:
        self.events.append((self.now(), text))
        print(f"[{self.now():7.1f}s] {text}", flush=True)

    # -- workers -------------------------------------------------------------------------------

    def spawn(self, slot: Slot) -> subprocess.Popen:
        """A new process for `slot`, once it is ready (seconds: the model loads). Not under the
        lock, so that memory sampling and chaos go on meanwhile."""
        slot.generation += 1
        name = f"{slot.name}-{slot.generation}"
        args = ("--lease-timeout-s", str(self.settings.lease_timeout_s), "--drain-grace-s", "5")
        process = spawn_worker(self.url, self.model_dir, name, *args, log_path=self.out / f"{name}.log")
        slot.started_at[process.pid] = self.now()
        return process

    def start_worker(self, slot: Slot) -> None:
        process = self.spawn(slot)
        with self.lock:
            if self.stop.is_set():
                process.kill()
                process.wait()
                return
            slot.process = process

    def restart_later(self, slot: Slot, delay_s: float) -> None:
        def later() -> None:
            time.sleep(delay_s)
            for _ in range(10):
                if self.stop.is_set():
                    return
                try:
                    self.start_worker(slot)
                except RuntimeError as exc:  # Redis away at its first contact: try again
                    self.log(f"{slot.name} did not start ({str(exc).splitlines()[0]}); retrying")
                    time.sleep(2)
                    continue
                self.log(f"{slot.name} restarted")
                return

        thread = threading.Thread(target=later, daemon=True)
        self.restarts.append(thread)
        thread.start()

    # -- the producer ------------------------------------------------------------------------------

    def produce(self) -> None:
        # Urgent jobs (priority 0) go to the stream's priority lane; the rest priority 5.
        client = Client(queue=f"{self.url}&high_lane_max_priority=0", results=self.url)
        i = 0
        next_burst = self.settings.burst_every_s
        while i < self.settings.num_jobs and not self.stop.is_set():
            count = 1
            if self.now() >= next_burst:
                count = self.settings.burst_size
                next_burst += self.settings.burst_every_s
            batch = []
            for _ in range(min(count, self.settings.num_jobs - i)):
                tokens = [1, 100 + self.rng.randrange(5000), 17]
                job = {
                    "id": f"soak-{i}",
                    "prompt_token_ids": tokens,
                    "priority": 0 if self.rng.random() < self.settings.urgent_share else 5,
                    "params": {"max_tokens": 8, "ignore_eos": True},
                }
                if self.settings.affinity_keys and self.rng.random() < 2 / 3:
                    job["affinity"] = f"key-{self.rng.randrange(self.settings.affinity_keys)}"
                batch.append(job)
                i += 1
            while True:
                try:
                    # A retry after a lost reply may enqueue a job twice: same id, so one result.
                    client.submit_many(batch)
                    break
                except redis_lib.RedisError:
                    time.sleep(0.2)
            self.submitted += [job["id"] for job in batch]
            time.sleep(1.0 / self.settings.rate)
        self.log(f"producer done: {len(self.submitted)} jobs submitted")

    # -- chaos ---------------------------------------------------------------------------------

    def redis_client(self) -> Any:
        if isinstance(self.server, ClusterStore):
            return self.server.client()
        return redis_lib.Redis(port=self.server.port, socket_timeout=10)

    def chaos(self) -> None:
        actions = ["kill", "term"]
        redis_at = self.settings.num_jobs * 0.4 / self.settings.rate
        move_at = self.settings.num_jobs * 0.7 / self.settings.rate
        while not self.stop.is_set():
            if self.stop.wait(self.rng.uniform(0.5, 1.5) * self.settings.chaos_every_s):
                return
            if isinstance(self.server, ClusterStore) and self.num_slot_moves == 0 and self.now() >= move_at:
                source = self.server.queue_node()
                target = self.rng.choice([n for n in self.server.cluster.nodes if n is not source])
                moved = self.server.cluster.migrate_slot(self.server.slot, target, batch=1, pause_s=0.5)
                self.num_slot_moves += 1
                self.log(f"queue slot {self.server.slot} moved to port {target.port} ({moved} keys)")
                continue
            if self.num_redis_restarts == 0 and self.now() >= redis_at:
                self.server.kill()
                self.log("redis killed")
                time.sleep(self.rng.uniform(1, 4))
                self.server.start()
                self.num_redis_restarts += 1
                self.log("redis restarted")
                continue
            action = actions[(self.num_kills + self.num_terms) % 2]
            with self.lock:
                live = [s for s in self.slots if s.process is not None and s.process.poll() is None]
                if len(live) < len(self.slots):
                    continue  # one is already down: keep at least one serving
                slot = self.rng.choice(live)
                assert slot.process is not None
                if action == "kill":
                    slot.process.send_signal(signal.SIGKILL)
                    slot.process.wait(timeout=30)
                    self.num_kills += 1
                    self.log(f"{slot.name} SIGKILLed")
                else:
                    slot.process.send_signal(signal.SIGTERM)
                    code = slot.process.wait(timeout=120)
                    self.num_terms += 1
                    self.log(f"{slot.name} SIGTERMed, exited {code}")
            self.restart_later(slot, self.rng.uniform(2, 5) if action == "kill" else 0.5)

    # -- memory --------------------------------------------------------------------------------

    def sample_memory(self) -> None:
        while not self.stop.wait(self.settings.sample_every_s):
            with self.lock:
                for slot in self.slots:
                    if slot.process is not None and slot.process.poll() is None:
                        rss = rss_bytes(slot.process.pid)
                        if rss is not None:
                            slot.samples.append((self.now(), slot.process.pid, rss))
            with contextlib.suppress(redis_lib.RedisError):
                self.redis_samples.append((self.now(), self.server.used_memory()))

    # -- the run -------------------------------------------------------------------------------

    def run(self) -> int:
        for slot in self.slots:
            self.start_worker(slot)
        threads = [
            threading.Thread(target=f, daemon=True) for f in (self.produce, self.chaos, self.sample_memory)
        ]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + self.settings.timeout_s
        r = self.redis_client()
        while time.monotonic() < deadline:
            time.sleep(2)
            try:
                done = self.count_results(r) if len(self.submitted) == self.settings.num_jobs else 0
            except redis_lib.RedisError:
                continue
            if done >= self.settings.num_jobs:
                break
        # Workers still in flight: let them finish what they hold, then stop them.
        time.sleep(2)
        self.stop.set()
        with self.lock:
            for slot in self.slots:
                if slot.process is not None and slot.process.poll() is None:
                    slot.process.send_signal(signal.SIGTERM)
            for slot in self.slots:
                if slot.process is not None:
                    slot.process.wait(timeout=120)
        for thread in self.restarts:  # a start in flight sees the stop once ready and kills its worker
            thread.join(timeout=180)
        summary = self.summarize(self.redis_client())
        self.server.stop()
        return 0 if summary["ok"] else 1

    def count_results(self, r: redis_lib.Redis) -> int:
        ids = list(self.submitted)
        n = 0
        for i in range(0, len(ids), 1000):
            keys = [
                constants.result_key(self.prefix, self.layout.job(job_id)) for job_id in ids[i : i + 1000]
            ]
            pipe = r.pipeline(transaction=False)
            for key in keys:
                pipe.exists(key)
            n += sum(1 for v in pipe.execute() if v)
        return n

    def summarize(self, r: redis_lib.Redis) -> dict:
        ids = sorted(set(self.submitted))
        num_results = self.count_results(r)
        duplicated: list[str] = []
        for i in range(0, len(ids), 500):
            chunk = ids[i : i + 500]
            pipe = r.pipeline(transaction=False)
            for job_id in chunk:
                pipe.xrange(constants.delta_stream_key(self.prefix, self.layout.job(job_id)))
            for job_id, entries in zip(chunk, pipe.execute(), strict=True):
                done = sum(1 for _, fields in entries if constants.DELTA_FIELD_DONE.encode() in fields)
                if done > 1:
                    duplicated.append(job_id)
        num_duplicated = len(duplicated)
        if duplicated:
            # Which jobs, to look them up in the workers' logs under the out folder.
            self.log(f"duplicated jobs: {', '.join(duplicated[:20])}")
        pending = sum(
            int(r.xpending(stream, "g")["pending"]) + int(r.xlen(stream)) for stream in self.streams.all
        )
        dead = int(r.xlen(constants.dead_letter_stream(self.stream)))
        memory = self.check_memory()
        summary = {
            "num_jobs": self.settings.num_jobs,
            "submitted": len(ids),
            "results": num_results,
            "lost": len(ids) - num_results + (self.settings.num_jobs - len(ids)),
            "duplicated": num_duplicated,
            "pending": pending,
            "dead_letters": dead,
            "worker_kills": self.num_kills,
            "worker_terms": self.num_terms,
            "redis_restarts": self.num_redis_restarts,
            "cluster": self.settings.cluster,
            "slot_moves": self.num_slot_moves,
            "seconds": round(self.now(), 1),
            **memory,
        }
        summary["ok"] = (
            summary["results"] == self.settings.num_jobs
            and summary["lost"] == 0
            and summary["duplicated"] == 0
            and summary["pending"] == 0
            and summary["dead_letters"] == 0
            and memory["memory_ok"]
            and self.num_redis_restarts == 1
            and self.num_slot_moves == (1 if self.settings.cluster else 0)
        )
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2))
        self.plot()
        for key, value in summary.items():
            print(f"{key}: {value}")
        return summary

    def check_memory(self) -> dict:
        warmup_s = self.settings.warmup_s
        worst_worker = 0
        for slot in self.slots:
            by_pid: dict[int, list[int]] = {}
            for t, pid, rss in slot.samples:
                if t - slot.started_at.get(pid, 0.0) >= warmup_s:
                    by_pid.setdefault(pid, []).append(rss)
            for series in by_pid.values():
                first, last = statistics.median(series[:3]), statistics.median(series[-3:])
                worst_worker = max(worst_worker, int(last - first))
        after = [m for t, m in self.redis_samples if t >= warmup_s]
        redis_growth = max(after) - after[0] if after else 0
        redis_bound = REDIS_BYTES_PER_JOB * self.settings.num_jobs + REDIS_GROWTH_SLACK_BYTES
        return {
            "worker_rss_growth_mib": round(worst_worker / MIB, 1),
            "worker_rss_bound_mib": WORKER_GROWTH_BOUND_BYTES // MIB,
            "redis_growth_mib": round(redis_growth / MIB, 1),
            "redis_bound_mib": round(redis_bound / MIB, 1),
            "memory_ok": worst_worker <= WORKER_GROWTH_BOUND_BYTES and redis_growth <= redis_bound,
        }

    def plot(self) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(10, 5))
        for slot in self.slots:
            pids = list(dict.fromkeys(pid for _, pid, _ in slot.samples))
            for n, pid in enumerate(pids):
                series = [(t, m) for t, p, m in slot.samples if p == pid]
                ax.plot(
                    [t for t, _ in series],
                    [m / MIB for _, m in series],
                    ".-",
                    color=f"C{self.slots.index(slot)}",
                    label=f"{slot.name} RSS" if n == 0 else None,
                )
        if self.redis_samples:
            ax.plot(
                [t for t, _ in self.redis_samples],
                [m / MIB for _, m in self.redis_samples],
                ".-",
                color="C3",
                label="redis used_memory",
            )
        for t, text in self.events:
            if "killed" in text or "SIG" in text:
                ax.axvline(t, color="grey", alpha=0.3)
        ax.axvline(self.settings.warmup_s, color="red", linestyle="--", label="warm-up end")
        ax.set_xlabel("seconds")
        ax.set_ylabel("MiB")
        ax.set_title(f"chaos soak: {self.settings.num_jobs} jobs, {len(self.slots)} workers")
        ax.legend()
        fig.savefig(self.out / "memory.png", dpi=100)


def rss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def run_soak(settings: SoakSettings) -> int:
    """One soak; 0 when every count is right. Whatever is left running is killed at the end."""
    soak = Soak(settings)
    try:
        return soak.run()
    finally:
        soak.stop.set()
        for slot in soak.slots:
            if slot.process is not None and slot.process.poll() is None:
                slot.process.kill()
        soak.server.stop()
