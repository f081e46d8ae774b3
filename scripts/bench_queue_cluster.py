"""The queue path on a Redis Cluster against a single Redis server: scripts/bench_queue.py's queue
mode (a worker on the main thread, the bench's run loop submitting every job and reading every
result beside it) on the same engine and requests, in interleaved rounds (single, cluster,
single, cluster, ...), because the machine is shared. The cluster is a private 3-primary one on
loopback ports (qworker/backends/redis/topologies.py); the single server is a private redis-server
too, so that both run with the same settings (no persistence).

    python scripts/bench_queue_cluster.py [--workload offline-mixed] [--num-requests 32] [--rounds 3]
    python scripts/bench_queue_cluster.py --fake-engine --num-requests 2000   # the queue path alone

With --fake-engine the worker runs qworker's scripted FakeEngine (one token per step, no model),
so that the run measures the queue path itself: leases, delta and result writes, acks, the
client's reads. With SmolLM2 the engine's time hides most of the queue's.

Prints one JSON line per run and, at the end, each pair's cluster/single output-throughput ratio
with the median; the load average is printed beside each run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_queue import run_queue

from qworker.backends.redis.server import RedisServer
from qworker.backends.redis.topologies import LocalCluster
from qworker.bench.qworker_engine import QworkerEngineSystem
from qworker.bench.run_loop import warm_up
from qworker.bench.workload import BenchRequest, load_workload, requests_for_model
from qworker.config import EngineConfig
from qworker.engine.llm_engine import LLMEngine
from qworker.testing.fake_engine import FakeEngine


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workload", default="offline-mixed")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-backlog", type=int, default=16)
    parser.add_argument(
        "--fake-engine", action="store_true", help="the scripted engine: the queue path alone"
    )
    args = parser.parse_args()

    engine: Any
    if args.fake_engine:
        workload = f"fake-engine, {args.num_requests} jobs of 16 prompt and 32 output tokens"
        rng = random.Random(0)
        requests = [
            BenchRequest(f"r{i}", i, [rng.randrange(256) for _ in range(16)], output_len=32, arrival_s=0.0)
            for i in range(args.num_requests)
        ]
        engine = FakeEngine(
            EngineConfig(model="fake", block_size=16, num_kv_blocks=8192, max_num_seqs=64), max_model_len=1024
        )
    else:
        spec = load_workload(args.workload).with_overrides(num_requests=args.num_requests)
        workload = spec.name
        requests = requests_for_model(spec, args.model)
        engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype))
        warm_up(QworkerEngineSystem("engine-only", engine.config, engine=engine), requests=requests)
    tmp = Path(tempfile.mkdtemp(prefix="qworker-bench-cluster-"))
    single = RedisServer(tmp / "single", appendonly=False).start()
    cluster = LocalCluster(tmp / "cluster").start()
    runs: dict[str, list[dict]] = {"single": [], "cluster": []}
    try:
        for _ in range(args.rounds):
            for mode, base in (("single", single.url), ("cluster", cluster.url)):
                result = run_queue(engine, requests, base, args.max_backlog, tmp)
                result.update(mode=mode, loadavg=os.getloadavg()[0])
                runs[mode].append(result)
                print(json.dumps(result), flush=True)
    finally:
        cluster.stop()
        single.stop()
    ratios = [
        c["output_throughput"] / s["output_throughput"]
        for s, c in zip(runs["single"], runs["cluster"], strict=True)
    ]
    print(
        json.dumps(
            {
                "workload": workload,
                "num_requests": len(requests),
                "model": args.model,
                "pair_ratios_cluster_over_single": [round(r, 4) for r in ratios],
                "median_ratio": round(statistics.median(ratios), 4),
                "command": "python " + " ".join(sys.argv),
                "date": time.strftime("%Y-%m-%d %H:%M"),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
