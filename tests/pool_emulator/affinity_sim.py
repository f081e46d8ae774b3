"""Pool affinity at internet scale, by simulation (issue 38): a seeded, pure-Python discrete-event
model of a pool of workers on one Redis Streams queue with affinity lanes, to see what the lanes
do for 64 workers and 2,000 prefixes where a machine cannot run the real pool.

Real code where it decides something (docs/queues.md, "Affinity lanes"):

- the producer's key: `qworker.jobs.affinity.affinity_key` of a real `Job` (a prompt of the
  prefix's text, 2,048+ characters, then the job's own question), and its lane:
  `QueueStreams.for_job` (`lane_index`);
- lane ownership: `lanes.lane_owner` per lane over the live set at each change (the rendezvous
  hash), checked against `owned_lanes` / `reading_order` for sampled workers at every change;
- the read: the order of `lane_reads.py`'s script, re-implemented over in-memory deques (the
  priority lane is empty here): the worker's own lanes and the shared stream an equal share each
  in turn (the own lanes turned by one per read, as `RedisStreamSource.reading_order` does), then
  the other lanes in index order, only entries that have waited `steal_after_s`;
- admission: `qworker.worker.admission.AdmissionPolicy.decide` on the worker's KV blocks and the
  jobs it holds, with `observe_prompt` as jobs are scheduled.

Modelled, not real:

- the engine: a step takes `step_base_s + prefill_s_per_token * prefill tokens + decode_s_per_seq
  * decoding sequences`; decodes go first, then prefill chunks within `max_num_batched_tokens`; a
  job is scheduled (FCFS) when its blocks fit. A job takes at scheduling all the blocks it will
  ever need (its suffix and output), and a prefix's blocks are held once per worker while any
  running job uses it: no preemption.
- the prefix cache: an LRU of `cache_prefixes` whole prefixes per worker, looked up when a job is
  first scheduled (a hit computes only the suffix) and filled then; kept apart from the blocks
  admission counts (the real engine counts unheld cached blocks as free too).
- heartbeats: a worker joins the live set when it is ready and leaves it when its drain ends, and
  every worker sees the change at once (the real workers see it within lease_timeout_s / 3 and
  stealing covers the gap). A draining worker keeps its lanes (it still heartbeats) but reads
  nothing, so its lanes' jobs wait steal_after_s and are stolen.
- KEDA: scale events at fixed times with the offered rate (the rate per target worker stays the
  same); new workers are ready after `cold_start_s` (+-20%); a scale-in drains the newest workers
  (a ReplicaSet's choice), which finish what they hold.
- an idle worker blocks on its own lanes and the stream (an arrival there wakes it at once) for at
  most min(poll_interval_s, steal_after_s), then reads again, stealing included.

`scripts/simulate_pool_affinity.py` runs it with affinity on and off and prints the tables.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import random
import statistics
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from qworker.backends.redis.lanes import QueueStreams, lane_owner, owned_lanes, reading_order
from qworker.backends.redis.lanes import _digest as _lane_digest
from qworker.jobs.affinity import affinity_key
from qworker.jobs.job import Job
from qworker.worker.admission import AdmissionPolicy, HeldJobSize, cdiv

STREAM = "sim"
# A prefix's text: enough words that its first 2,048 characters (what the key hashes) are its own.
_WORDS = ["lorem", "ipsum", "dolor", "sit", "amet", "consectetur"]


@dataclass(frozen=True)
class Phase:
    """From `start_s` on, the pool's target size and the offered rate (jobs per second)."""

    start_s: float
    workers: int
    rate: float


@dataclass(frozen=True)
class SimConfig:
    num_lanes: int = 256
    num_prefixes: int = 2000
    zipf_s: float = 1.1
    prefix_tokens: int = 1024
    suffix_tokens: tuple[int, int] = (16, 64)
    output_tokens: tuple[int, int] = (16, 64)
    # Per worker: an LRU of this many whole prefixes.
    cache_prefixes: int = 16
    # Per worker: the KV blocks admission counts.
    block_size: int = 16
    num_kv_blocks: int = 2048
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_backlog: int = 8
    reserve_blocks_per_seq: int = 1
    # The engine's step time: a large model's decode step, and its prefill at 2,000 tokens/s.
    step_base_s: float = 0.05
    prefill_s_per_token: float = 0.0005
    decode_s_per_seq: float = 0.0005
    steal_after_s: float = 0.5
    poll_interval_s: float = 0.5
    cold_start_s: float = 20.0
    # A scale event every 100 s: 64 -> 80 -> 48 workers, the rate following the target (1.6 jobs/s
    # a worker: about 70% of a worker's capacity without affinity on these jobs).
    phases: tuple[Phase, ...] = (
        Phase(0.0, 64, 64 * 1.6),
        Phase(100.0, 80, 80 * 1.6),
        Phase(200.0, 48, 48 * 1.6),
    )
    duration_s: float = 300.0
    # Hit rates and waits count jobs that arrive from here on (the caches are cold at t=0).
    measure_from_s: float = 30.0
    seed: int = 0


@dataclass
class SimJob:
    index: int
    prefix: int
    lane: int  # index into the reader's stream list: 0..L-1 lanes, L the stream itself
    suffix: int
    output: int
    arrival: float
    leased_at: float = -1.0
    first_token_at: float = -1.0
    finished_at: float = -1.0
    worker: int = -1
    stolen: bool = False
    hit: bool = False
    # Engine state on its worker.
    prefill_left: int = 0
    finish_step: int = 0
    blocks: int = 0
    is_started: bool = False


@dataclass
class SimWorker:
    index: int
    name: str
    policy: AdmissionPolicy
    ready_at: float
    cache: OrderedDict[int, None] = field(default_factory=OrderedDict)
    waiting: deque[SimJob] = field(default_factory=deque)  # held, not scheduled
    prefilling: list[SimJob] = field(default_factory=list)
    decoding: list[tuple[int, int, SimJob]] = field(default_factory=list)  # heap by finish step
    prefix_users: dict[int, int] = field(default_factory=dict)  # prefix -> running jobs using it
    used_blocks: int = 0
    step: int = 0
    busy: bool = False  # a step is scheduled
    idle_token: int = 0  # the pending poll of an idle worker (stale polls carry an older one)
    is_draining: bool = False
    is_live: bool = False
    has_left: bool = False
    rotation: int = 0

    @property
    def num_held(self) -> int:
        return len(self.waiting) + len(self.prefilling) + len(self.decoding)


class Simulation:
    def __init__(self, config: SimConfig, affinity: bool) -> None:
        self.config = config
        self.affinity = affinity
        self.num_lanes = config.num_lanes if affinity else 1
        self.streams = QueueStreams.of(STREAM, self.num_lanes, cluster=False)
        # Reader-side stream list: the lanes by index, then the stream itself.
        self.stream_ids = {name: i for i, name in enumerate(self.streams.lanes)}
        self.stream_ids[self.streams.stream] = len(self.streams.lanes)
        self.queues: list[deque[SimJob]] = [deque() for _ in range(len(self.streams.lanes) + 1)]
        self.rng = random.Random(config.seed)
        self.events: list[tuple[float, int, str, Any]] = []
        self.seq = itertools.count()
        self.now = 0.0
        self.workers: list[SimWorker] = []
        self.owner: list[int] = []  # lane -> worker index
        self.fair: dict[int, list[int]] = {}  # worker -> [stream, own lanes...] (stream ids)
        self.stealable: dict[int, list[int]] = {}
        self.jobs: list[SimJob] = []
        self.oldest: list[tuple[float, int]] = []  # (arrival, job index) of waiting entries, lazy
        self.waiting_index: set[int] = set()
        self.ownership_changes: list[dict[str, Any]] = []
        self.scale_events: list[dict[str, Any]] = []
        self.blocked: dict[int, set[int]] = {}  # stream id -> idle workers blocked on it
        self._prefix_texts = [self._prefix_text(k) for k in range(config.num_prefixes)]
        self._zipf_cum = list(
            itertools.accumulate(1.0 / (k + 1) ** config.zipf_s for k in range(config.num_prefixes))
        )
        self._key_cache: dict[int, str] = {}
        self._scores: dict[tuple[int, int], tuple[int, str]] = {}
        self._check_next = False
        self.key_checks = 0

    # -- the producer ------------------------------------------------------------------------

    def _prefix_text(self, k: int) -> str:
        words = random.Random(f"prefix-{k}").choices(_WORDS, k=420)
        return f"Document {k}.\n" + " ".join(words) + "\n\n"

    def _lane_of(self, prefix: int, question: str) -> int:
        """The real producer rule on a real Job: its derived key, then its stream."""
        job = Job(prompt=self._prefix_texts[prefix] + question, params={"max_tokens": 16})
        key = affinity_key(job)
        assert key is not None, "a prompt past a block always gets a key"
        if prefix in self._key_cache:
            assert self._key_cache[prefix] == key, "the key depends on the prefix only"
        self._key_cache[prefix] = key
        self.key_checks += 1
        return self.stream_ids[self.streams.for_job(key, is_urgent=False)]

    def _arrive(self) -> None:
        c = self.config
        rate = self._phase(self.now).rate
        index = len(self.jobs)
        prefix = bisect.bisect_left(self._zipf_cum, self.rng.random() * self._zipf_cum[-1])
        suffix = self.rng.randint(*c.suffix_tokens)
        output = self.rng.randint(*c.output_tokens)
        lane = self._lane_of(
            prefix, f"Question {index}: what does it say about item {self.rng.randrange(10**6)}?"
        )
        job = SimJob(index, prefix, lane, suffix, output, self.now)
        self.jobs.append(job)
        self.queues[lane].append(job)
        heapq.heappush(self.oldest, (job.arrival, index))
        self.waiting_index.add(index)
        # A blocking read on that stream wakes one of the idle workers blocked on it.
        blocked = self.blocked.get(lane)
        if blocked:
            worker = self.workers[min(blocked)]
            self._wake(worker)
        gap = self.rng.expovariate(rate)
        if self.now + gap < c.duration_s:
            self._push(self.now + gap, "arrive", None)

    def _phase(self, t: float) -> Phase:
        return [p for p in self.config.phases if p.start_s <= t][-1]

    # -- events ------------------------------------------------------------------------------

    def _push(self, t: float, kind: str, payload: Any) -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, payload))

    def run(self) -> dict[str, Any]:
        started = time.perf_counter()
        c = self.config
        first = c.phases[0]
        for _ in range(first.workers):
            self._add_worker(ready_at=0.0)
        self._set_live()
        for phase in c.phases[1:]:
            self._push(phase.start_s, "scale", phase)
        self._push(0.0, "arrive", None)
        for worker in self.workers:
            self._push(0.0, "poll", (worker.index, worker.idle_token))
        while self.events:
            self.now, _, kind, payload = heapq.heappop(self.events)
            if kind == "arrive":
                self._arrive()
            elif kind == "step":
                self._end_step(self.workers[payload])
            elif kind == "poll":
                index, token = payload
                worker = self.workers[index]
                if token == worker.idle_token and not worker.busy:
                    self._unblock(worker)
                    self._work(worker)
            elif kind == "ready":
                self._ready(self.workers[payload])
            elif kind == "scale":
                self._scale(payload)
        return self._report(time.perf_counter() - started)

    # -- the pool ----------------------------------------------------------------------------

    def _add_worker(self, ready_at: float) -> SimWorker:
        c = self.config
        index = len(self.workers)
        policy = AdmissionPolicy(
            block_size=c.block_size,
            max_backlog=c.max_backlog,
            reserve_blocks_per_seq=c.reserve_blocks_per_seq,
            max_jobs_held=c.max_num_seqs,
        )
        worker = SimWorker(index, f"sim-worker-{index:03d}", policy, ready_at)
        if ready_at <= self.now:
            worker.is_live = True
        self.workers.append(worker)
        return worker

    def _live_names(self) -> list[str]:
        return [w.name for w in self.workers if w.is_live]

    def _set_live(self, cause: str = "start") -> None:
        """Lane ownership over the live set (real rendezvous hashing), and what moved."""
        live = [w for w in self.workers if w.is_live]
        names = [w.name for w in live]
        by_name = {w.name: w.index for w in live}
        new_owner = self._owners(live) if self.streams.lanes else []
        # Checked against lanes.lane_owner itself for every lane at the start and at the first
        # change of each scale event (a full check at every change costs more than the rest).
        is_checked = not self.owner or self._check_next
        if self.streams.lanes and is_checked:
            assert new_owner == [by_name[str(lane_owner(i, names))] for i in range(self.num_lanes)]
        self._check_next = False
        if self.owner and new_owner:
            moved = sum(a != b for a, b in zip(self.owner, new_owner, strict=True))
            self.ownership_changes.append(
                {
                    "t": self.now,
                    "cause": cause,
                    "live_before": len(self.fair),
                    "live": len(names),
                    "lanes_moved": moved,
                    "owner_after": new_owner,
                }
            )
        self.owner = new_owner
        stream = len(self.streams.lanes)
        self.fair = {w.index: [stream] for w in live}
        for lane, owner in enumerate(new_owner):
            self.fair[owner].append(lane)
        self.stealable = {
            w.index: [lane for lane, owner in enumerate(new_owner) if owner != w.index] for w in live
        }
        # The real reading order of one worker (a different one each time, at the same checks):
        # the same streams, in the same order.
        if is_checked:
            w = live[len(self.ownership_changes) % len(live)]
            order = reading_order(self.streams, w.name, names, 0)
            assert [self.stream_ids[s] for s in order.fair] == self.fair[w.index]
            assert [self.stream_ids[s] for s in order.stealable] == self.stealable[w.index]
            if self.streams.lanes:
                assert owned_lanes(w.name, names, self.num_lanes) == self.fair[w.index][1:]
        # Re-block idle workers on their new streams.
        for w in live:
            if not w.busy:
                self._unblock(w)
                self._block(w)

    def _score(self, worker: SimWorker, lane: int) -> tuple[int, str]:
        """lane_owner's rendezvous key for (worker, lane), with lanes.py's own hash, memoized."""
        key = (worker.index, lane)
        score = self._scores.get(key)
        if score is None:
            score = self._scores[key] = (_lane_digest(f"{worker.name}\n{lane}"), worker.name)
        return score

    def _owners(self, live: list[SimWorker]) -> list[int]:
        """Each lane's owner among `live`: the highest rendezvous key, as lane_owner computes it."""
        return [
            max(live, key=lambda w, lane=lane: self._score(w, lane)).index for lane in range(self.num_lanes)
        ]

    def _scale(self, phase: Phase) -> None:
        self._check_next = True
        c = self.config
        serving = [w for w in self.workers if not w.is_draining and not w.has_left]
        event = {
            "t": self.now,
            "from": len(serving),
            "to": phase.workers,
            "changes_from": len(self.ownership_changes),
            "owner_before": list(self.owner),
        }
        self.scale_events.append(event)
        if phase.workers > len(serving):
            for _ in range(phase.workers - len(serving)):
                ready_at = self.now + c.cold_start_s * self.rng.uniform(0.8, 1.2)
                worker = self._add_worker(ready_at)
                self._push(ready_at, "ready", worker.index)
        else:
            for worker in sorted(serving, key=lambda w: -w.ready_at)[: len(serving) - phase.workers]:
                worker.is_draining = True
                if not worker.busy and worker.num_held == 0:
                    self._leave(worker)

    def _ready(self, worker: SimWorker) -> None:
        worker.is_live = True
        self._set_live("join")
        self._work(worker)

    def _leave(self, worker: SimWorker) -> None:
        """The drain ended: its heartbeat leaves the set, and its lanes move to the others."""
        self._unblock(worker)
        worker.is_live = False
        worker.has_left = True
        self._set_live("leave")

    # -- a worker's loop -----------------------------------------------------------------------

    def _block(self, worker: SimWorker) -> None:
        """Idle: wait on its own lanes and the stream, at most until its next poll."""
        worker.idle_token += 1
        if self.now >= self.config.duration_s and not self.waiting_index:
            return  # the arrivals are over and the queue is empty: the run ends
        for stream in self.fair.get(worker.index, []):
            self.blocked.setdefault(stream, set()).add(worker.index)
        wait = self.config.poll_interval_s
        if self.stealable.get(worker.index):
            wait = min(wait, self.config.steal_after_s)
        self._push(self.now + wait, "poll", (worker.index, worker.idle_token))

    def _unblock(self, worker: SimWorker) -> None:
        for stream in self.fair.get(worker.index, []):
            self.blocked.get(stream, set()).discard(worker.index)

    def _wake(self, worker: SimWorker) -> None:
        self._unblock(worker)
        worker.idle_token += 1
        self._push(self.now, "poll", (worker.index, worker.idle_token))

    def _work(self, worker: SimWorker) -> None:
        """Lease what admission allows, then run a step (or block when there is nothing)."""
        if not worker.is_live or worker.has_left:
            return
        if not worker.is_draining:
            self._lease(worker)
        if worker.num_held:
            self._start_step(worker)
        elif worker.is_draining:
            self._leave(worker)
        else:
            self._block(worker)

    def _has_readable(self, worker: SimWorker) -> bool:
        if any(self.queues[s] for s in self.fair[worker.index]):
            return True
        cutoff = self.now - self.config.steal_after_s
        while self.oldest and self.oldest[0][1] not in self.waiting_index:
            heapq.heappop(self.oldest)
        return bool(self.stealable[worker.index]) and bool(self.oldest) and self.oldest[0][0] <= cutoff

    def _lease(self, worker: SimWorker) -> None:
        if len(worker.waiting) >= worker.policy.max_backlog or not self._has_readable(worker):
            return
        c = self.config
        held = [
            HeldJobSize(j.suffix + c.prefix_tokens, j.output, 0, False, self._shared(worker, j))
            for j in worker.waiting
        ]
        for j in worker.prefilling:
            held.append(HeldJobSize(j.suffix + c.prefix_tokens, j.output, 0, False, 0))
        for finish_step, _, j in worker.decoding:
            done = j.output - (finish_step - worker.step)
            held.append(HeldJobSize(j.suffix + c.prefix_tokens, j.output, done, True, 0))
        decision = worker.policy.decide(c.num_kv_blocks, c.num_kv_blocks - worker.used_blocks, held)
        count = decision.num_jobs_to_pull
        if count <= 0:
            return
        for job in self._read(worker, count):
            job.leased_at = self.now
            job.worker = worker.index
            self.waiting_index.discard(job.index)
            worker.waiting.append(job)

    def _shared(self, worker: SimWorker, job: SimJob) -> int:
        """Prefix tokens a job not yet scheduled would share with running jobs of its worker."""
        return self.config.prefix_tokens if worker.prefix_users.get(job.prefix) else 0

    def _read(self, worker: SimWorker, count: int) -> list[SimJob]:
        """lane_reads.py's order: the fair streams an equal share each in turn, then stealing."""
        fair = self.fair[worker.index]
        worker.rotation += 1
        turn_by = worker.rotation % len(fair)
        turn = fair[turn_by:] + fair[:turn_by]
        out: list[SimJob] = []
        left = count
        while left > 0 and turn:
            share = max(1, left // len(turn))
            again = []
            for stream in turn:
                if left <= 0:
                    break
                queue = self.queues[stream]
                got = 0
                while queue and got < min(share, left):
                    out.append(queue.popleft())
                    got += 1
                left -= got
                if got == share:
                    again.append(stream)
            turn = again
        if left > 0 and self.stealable[worker.index]:
            cutoff = self.now - self.config.steal_after_s
            if self.oldest and self.oldest[0][0] <= cutoff:
                for lane in self.stealable[worker.index]:
                    queue = self.queues[lane]
                    while left > 0 and queue and queue[0].arrival <= cutoff:
                        job = queue.popleft()
                        job.stolen = True
                        out.append(job)
                        left -= 1
                    if left <= 0:
                        break
        return out

    # -- the engine ----------------------------------------------------------------------------

    def _start_step(self, worker: SimWorker) -> None:
        c = self.config
        budget = c.max_num_batched_tokens - len(worker.decoding)
        prefill = 0
        # Prefill chunks: jobs already prefilling first, then new ones while blocks allow.
        for job in worker.prefilling:
            chunk = min(job.prefill_left, budget - prefill)
            job.prefill_left -= chunk
            prefill += chunk
        while (
            worker.waiting
            and prefill < budget
            and len(worker.prefilling) + len(worker.decoding) < c.max_num_seqs
        ):
            job = worker.waiting[0]
            hit = job.prefix in worker.cache
            own = cdiv(job.suffix + job.output, c.block_size)
            shared = 0 if worker.prefix_users.get(job.prefix) else cdiv(c.prefix_tokens, c.block_size)
            if worker.used_blocks + own + shared > c.num_kv_blocks:
                break
            worker.waiting.popleft()
            worker.used_blocks += own + shared
            job.blocks = own
            worker.prefix_users[job.prefix] = worker.prefix_users.get(job.prefix, 0) + 1
            job.hit = hit
            if hit:
                worker.cache.move_to_end(job.prefix)
            else:
                worker.cache[job.prefix] = None
                if len(worker.cache) > c.cache_prefixes:
                    worker.cache.popitem(last=False)
            uncached = job.suffix + (0 if hit else c.prefix_tokens)
            worker.policy.observe_prompt(job.suffix + c.prefix_tokens, c.prefix_tokens if hit else 0)
            chunk = min(uncached, budget - prefill)
            job.prefill_left = uncached - chunk
            prefill += chunk
            worker.prefilling.append(job)
        duration = c.step_base_s + c.prefill_s_per_token * prefill + c.decode_s_per_seq * len(worker.decoding)
        worker.busy = True
        self._push(self.now + duration, "step", worker.index)

    def _end_step(self, worker: SimWorker) -> None:
        worker.busy = False
        worker.step += 1
        # Decodes that produced their last token.
        while worker.decoding and worker.decoding[0][0] <= worker.step:
            _, _, job = heapq.heappop(worker.decoding)
            self._finish(worker, job)
        # Prefills that completed: their first token comes with this step.
        still = []
        for job in worker.prefilling:
            if job.prefill_left > 0:
                still.append(job)
                continue
            job.first_token_at = self.now
            job.is_started = True
            if job.output <= 1:
                self._finish(worker, job)
            else:
                heapq.heappush(worker.decoding, (worker.step + job.output - 1, job.index, job))
        worker.prefilling = still
        self._work(worker)

    def _finish(self, worker: SimWorker, job: SimJob) -> None:
        job.finished_at = self.now
        worker.used_blocks -= job.blocks
        users = worker.prefix_users[job.prefix] - 1
        if users:
            worker.prefix_users[job.prefix] = users
        else:
            del worker.prefix_users[job.prefix]
            worker.used_blocks -= cdiv(self.config.prefix_tokens, self.config.block_size)

    # -- the report ----------------------------------------------------------------------------

    def _report(self, wall_s: float) -> dict[str, Any]:
        c = self.config
        measured = [j for j in self.jobs if j.arrival >= c.measure_from_s]
        done = [j for j in measured if j.finished_at >= 0]
        prompt = sum(j.suffix + c.prefix_tokens for j in done)
        cached = sum(c.prefix_tokens for j in done if j.hit)

        def window(lo: float, hi: float) -> dict[str, Any]:
            jobs = [j for j in done if lo <= j.arrival < hi]
            return {
                "from_s": lo,
                "to_s": hi,
                "jobs": len(jobs),
                "hit_rate": sum(j.hit for j in jobs) / len(jobs) if jobs else None,
                "queue_wait_p99_s": _percentile([j.leased_at - j.arrival for j in jobs], 99),
            }

        bounds = [p.start_s for p in c.phases] + [c.duration_s]
        phases = [window(max(lo, c.measure_from_s), hi) for lo, hi in itertools.pairwise(bounds)]
        after_events = [window(e["t"], e["t"] + 60.0) for e in self.scale_events]
        events = []
        for i, e in enumerate(self.scale_events):
            end = self.scale_events[i + 1]["changes_from"] if i + 1 < len(self.scale_events) else None
            changes = self.ownership_changes[e["changes_from"] : end]
            delta = abs(e["to"] - e["from"])
            big = max(e["to"], e["from"])
            before = e.pop("owner_before")
            after = changes[-1]["owner_after"] if changes else before
            # Each change (one worker joining or leaving) against rendezvous hashing's expectation:
            # a joining worker takes L / (N + 1) lanes, a leaving one hands over its L / N.
            per_change = [
                {
                    "live_before": ch["live_before"],
                    "live_after": ch["live"],
                    "lanes_moved": ch["lanes_moved"],
                    "expected": self.num_lanes / max(ch["live"], ch["live_before"]),
                }
                for ch in changes
            ]
            events.append(
                {
                    **e,
                    "live_set_changes": len(changes),
                    # Summed over the changes (a lane that moves twice counts twice).
                    "lanes_moved": sum(ch["lanes_moved"] for ch in changes),
                    "lanes_moved_expected": sum(ch["expected"] for ch in per_change),
                    # Owners before the event against after its last change.
                    "lanes_moved_net": sum(a != b for a, b in zip(before, after, strict=True)),
                    "lanes_moved_net_expected": self.num_lanes * delta / big if self.streams.lanes else 0,
                    "per_change": per_change,
                }
            )
        for ch in self.ownership_changes:
            ch.pop("owner_after", None)
        waits = [j.leased_at - j.arrival for j in done]
        ttfts = [j.first_token_at - j.arrival for j in done]
        last_finish = max((j.finished_at for j in self.jobs if j.finished_at >= 0), default=0.0)
        return {
            "affinity": self.affinity,
            "num_lanes": self.num_lanes,
            "jobs": len(self.jobs),
            "measured_jobs": len(measured),
            "completed": len(done),
            "hit_rate": sum(j.hit for j in done) / len(done) if done else None,
            "cached_token_share": cached / prompt if prompt else None,
            "prompt_tokens_computed": prompt - cached,
            "stolen_share": sum(j.stolen for j in done) / len(done) if done else None,
            "queue_wait_p50_s": _percentile(waits, 50),
            "queue_wait_p99_s": _percentile(waits, 99),
            "ttft_p50_s": _percentile(ttfts, 50),
            "ttft_p99_s": _percentile(ttfts, 99),
            "mean_e2e_s": statistics.fmean(j.finished_at - j.arrival for j in done) if done else None,
            "last_finish_s": last_finish,
            "phases": phases,
            "after_scale_events": after_events,
            "scale_events": events,
            "key_checks": self.key_checks,
            "wall_s": wall_s,
        }


def _percentile(values: Sequence[float], p: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    lo, hi = math.floor(rank), math.ceil(rank)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def simulate(config: SimConfig) -> dict[str, Any]:
    """Affinity on (config.num_lanes lanes) and off (one stream), on the same seeded arrivals."""
    on = Simulation(config, affinity=True).run()
    off = Simulation(config, affinity=False).run()
    return {"config": asdict(config), "on": on, "off": off}
