"""Adapter loads in a pool (issue 39's third measure): two `qworker worker` processes, 8 LoRA
adapters, `--enable-lora --max-loras 2 --max-cpu-loras 4`, N short jobs each naming one adapter
(uniformly at random, seeded), all enqueued at once; once with `affinity_lanes=16` on the queue URL
(a job's adapter is its affinity key: `adapter:<name>`) and once without. It reports each run's
adapter loads (reads of an adapter's files into a worker's host memory: misses of max_cpu_loras,
the stats report's num_adapter_loads) per worker and in total, loads per 1,000 jobs, the device
slot fills beside them, wall time and jobs per worker, as a markdown table.

The model is the tiny random Llama with the SmolLM2 tokenizer (worker_kit.write_tiny_model_dir),
not SmolLM2 itself: the run counts loads, and 2,000 jobs through SmolLM2 on 2 cores would be
mostly decoding. Jobs are a few prompt token ids and 3 greedy tokens. Adapters are rank 16 on
every projection, made as scripts/bench_lora.py makes them (peft for the first, new random values
for the others). Each run has its own stream and its own two fresh workers (counts start at 0),
on a private redis-server on a free loopback port. Workers and the server are killed on any exit.

    .venv/bin/python scripts/bench_lora_pool.py --num-jobs 1000
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import redis

from qworker.backends.redis.keys import worker_stats_key
from qworker.backends.redis.lanes import lane_index, lane_owner
from qworker.backends.redis.server import RedisServer
from qworker.engine.sampling_params import SamplingParams
from qworker.jobs.client import Client
from qworker.jobs.job import Job
from qworker.jobs.result import JobStatus
from qworker.testing.worker_kit import (
    kill_group,
    kill_processes_with_env,
    spawn_worker,
    unique_url,
    write_tiny_model_dir,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_lora import TARGETS, make_adapters

NUM_ADAPTERS = 8
NUM_WORKERS = 2
LORA_SETTINGS = ("--enable-lora", "--max-loras", "2", "--max-cpu-loras", "4", "--max-lora-rank", "16")
STATS_INTERVAL_S = 0.5
# Every worker this script starts inherits this variable: the last cleanup kills them by it, so
# that a worker still starting when SIGTERM came (not yet in a Pool) is killed too.
MARK = "BENCH_LORA_POOL_RUN"  # not a qworker setting: no QWORKER_ prefix
# A worker refreshes its view of the live workers (who owns which lane) at most three times per
# lease (30 s by default): the first worker to start owns every lane in its own eyes for up to
# 10 s after the second joins. Jobs enqueued before both views agree would all be read as the
# first worker's own, so each run waits this long after its workers are ready.
LIVE_SET_SETTLE_S = 30.0 / 3 + 1.0


class Pool:
    """The processes of one run, killed together (SIGKILL to each worker's process group)."""

    def __init__(self) -> None:
        self.workers: list[subprocess.Popen] = []

    def kill(self) -> None:
        for worker in self.workers:
            kill_group(worker)
        self.workers.clear()


def make_jobs(num_jobs: int, names: list[str], seed: int, max_tokens: int) -> list[Job]:
    rng = random.Random(seed)
    return [
        Job(
            prompt_token_ids=[rng.randrange(3, 4000) for _ in range(4)],
            params=SamplingParams(max_tokens=max_tokens, temperature=0.0),
            lora=rng.choice(names),
        )
        for _ in range(num_jobs)
    ]


def final_stats(client: redis.Redis, url: str, names: list[str], num_jobs: int, timeout_s: float) -> dict:
    """Each worker's stats report once the reports account for every job (they are written every
    STATS_INTERVAL_S, so the last results may be ahead of them)."""
    prefix = url.split("prefix=", 1)[1].split("&", 1)[0]
    deadline = time.monotonic() + timeout_s
    while True:
        reports = {}
        for name in names:
            raw = client.get(worker_stats_key(prefix, name))
            reports[name] = json.loads(raw) if raw is not None else {}
        finished = sum(r.get("num_completed", 0) + r.get("num_failed", 0) for r in reports.values())
        if finished >= num_jobs or time.monotonic() > deadline:
            return reports
        time.sleep(STATS_INTERVAL_S / 2)


def run_once(
    lanes: int, args: argparse.Namespace, server: RedisServer, model_dir: Path, modules: str, root: Path
) -> dict[str, Any]:
    tag = f"lorapool-{'lanes' if lanes > 1 else 'nolanes'}"
    url = unique_url(server.url, tag)
    if lanes > 1:
        url += f"&affinity_lanes={lanes}"
        if args.steal_after_s is not None:
            url += f"&steal_after_s={args.steal_after_s}"
    names = [f"{tag}-w{i}" for i in range(NUM_WORKERS)]
    pool = Pool()
    try:
        worker_args = (*LORA_SETTINGS, "--lora-modules", modules, "--stats-interval-s", str(STATS_INTERVAL_S))
        for name in names:
            log_path = root / f"{name}.log"
            pool.workers.append(spawn_worker(url, model_dir, name, *worker_args, log_path=log_path))
        time.sleep(LIVE_SET_SETTLE_S)
        adapter_names = [f"adapter-{i}" for i in range(NUM_ADAPTERS)]
        jobs = make_jobs(args.num_jobs, adapter_names, args.seed, args.max_tokens)
        with Client(url) as client:
            started = time.perf_counter()
            ids = client.submit_many(jobs)
            results = client.results(ids, timeout=args.timeout_s)
            wall_s = time.perf_counter() - started
        failed = [r for r in results if r.status != JobStatus.COMPLETED]
        assert not failed, f"{len(failed)} jobs did not complete, e.g. {failed[0].error}"
        reports = final_stats(redis.Redis.from_url(server.url), url, names, args.num_jobs, 30.0)
    finally:
        pool.kill()
    jobs_of = {name: sum(1 for r in results if r.worker == name) for name in names}
    loads = {name: reports[name].get("num_adapter_loads", 0) for name in names}
    slot_loads = {name: reports[name].get("num_adapter_slot_loads", 0) for name in names}
    total = sum(loads.values())
    # With lanes, each adapter's jobs go to one lane, and its owner reads them first: a worker
    # that owns more adapters than max_cpu_loras must evict some of them even with affinity.
    owned = {name: 0 for name in names}
    if lanes > 1:
        for adapter in adapter_names:
            owned[lane_owner(lane_index(f"adapter:{adapter}", lanes), names)] += 1
    return {
        "affinity": f"on (affinity_lanes={lanes})" if lanes > 1 else "off",
        "jobs": len(results),
        "loads_per_worker": [loads[n] for n in names],
        "loads": total,
        "loads_per_1000_jobs": round(1000 * total / len(results), 1),
        "slot_loads_per_worker": [slot_loads[n] for n in names],
        "wall_s": round(wall_s, 1),
        "jobs_per_worker": [jobs_of[n] for n in names],
        "adapters_owned_per_worker": [owned[n] for n in names] if lanes > 1 else None,
    }


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| affinity | jobs | adapter loads per worker | loads | loads per 1,000 jobs "
        "| slot loads per worker | wall s | jobs per worker | adapters whose lane each owns |",
        "|---|---:|---|---:|---:|---|---:|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['affinity']} | {r['jobs']} | {' + '.join(map(str, r['loads_per_worker']))} | {r['loads']} "
            f"| {r['loads_per_1000_jobs']} | {' + '.join(map(str, r['slot_loads_per_worker']))} "
            f"| {r['wall_s']} | {' + '.join(map(str, r['jobs_per_worker']))} "
            f"| {' + '.join(map(str, r['adapters_owned_per_worker'] or ['-']))} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-jobs", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=3)
    parser.add_argument("--lanes", type=int, default=16, help="affinity_lanes of the run with affinity")
    parser.add_argument(
        "--steal-after-s", type=float, default=None, help="the lanes' steal delay (none: the queue's default)"
    )
    parser.add_argument("--order", default="on,off", help="which run first")
    parser.add_argument("--seed", type=int, default=0, help="the jobs' prompts and adapters")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="each run's wait for its results")
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = parser.parse_args()

    # SIGTERM ends the run as an exception would, so that the finally blocks kill the processes.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    os.environ[MARK] = uuid.uuid4().hex
    root = Path(tempfile.mkdtemp(prefix="bench-lora-pool-"))
    server = RedisServer(root / "redis", appendonly=False)
    assert server.port != 6379, "never the shared Redis"
    try:
        model_dir = write_tiny_model_dir(root / "tiny")
        dirs = make_adapters(model_dir, root, NUM_ADAPTERS, 16, TARGETS["all"])
        modules = ",".join(f"adapter-{i}={d}" for i, d in enumerate(dirs))
        server.start()
        rows = []
        for which in args.order.split(","):
            rows.append(run_once(args.lanes if which == "on" else 1, args, server, model_dir, modules, root))
            print(json.dumps(rows[-1]), flush=True)
    except BaseException:
        print(f"worker logs kept in {root}", file=sys.stderr)
        raise
    finally:
        kill_processes_with_env(MARK, os.environ[MARK])
        server.stop()
    print(markdown(rows))
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=2))
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
