"""What the gateway adds to TTFT and E2EL against `Client`, from one `qworker bench --mode queue,http`
run's results.json: each http run is paired with the queue run before it (same request set, same
worker), and each request's http TTFT (E2EL) with its own queue TTFT (E2EL). Prints per round the
medians and the median paired difference, then the median and interquartile range of all pairs.

    qworker bench -w gateway-overhead --mode queue,http --systems qworker --rate inf,inf,inf,inf \\
        --warmup 2 --no-compute-limit --no-plots --out bench_out/gateway-overhead
    .venv/bin/python scripts/gateway_overhead_pairs.py bench_out/gateway-overhead/results.json
"""

from __future__ import annotations

import json
import statistics
import sys
from typing import Any


def ttft(record: dict[str, Any]) -> float | None:
    if record["status"] != "completed" or not record["chunk_times"]:
        return None
    return record["chunk_times"][0] - record["arrival_time"]


def e2el(record: dict[str, Any]) -> float | None:
    return record["finish_time"] - record["arrival_time"] if record["status"] == "completed" else None


def paired(queue: dict[str, Any], http: dict[str, Any], metric: Any) -> list[float]:
    by_id = {r["request_id"]: r for r in http["records"]}
    diffs = []
    for record in queue["records"]:
        a, b = metric(record), metric(by_id[record["request_id"]])
        if a is not None and b is not None:
            diffs.append(b - a)
    return diffs


def quartiles(values: list[float]) -> tuple[float, float]:
    q1, _, q3 = statistics.quantiles(values, n=4)
    return q1, q3


def main() -> None:
    with open(sys.argv[1]) as f:
        runs = json.load(f)["runs"]
    rounds, last_queue = [], None
    for run in runs:
        if run["mode"] == "queue":
            last_queue = run
        elif run["mode"] == "http":
            assert last_queue is not None, "an http run with no queue run before it"
            assert run["request_set_sha256"] == last_queue["request_set_sha256"]
            rounds.append((last_queue, run))
    all_ttft: list[float] = []
    all_e2el: list[float] = []
    for i, (queue, http) in enumerate(rounds):
        dt, de = paired(queue, http, ttft), paired(queue, http, e2el)
        medians = [
            statistics.median([v for r in run["records"] if (v := metric(r)) is not None]) * 1e3
            for metric in (ttft, e2el)
            for run in (queue, http)
        ]
        done = [sum(r["status"] == "completed" for r in run["records"]) for run in (queue, http)]
        print(
            f"round {i}: completed {done[0]}/{len(queue['records'])} queue, {done[1]} http; "
            f"median TTFT {medians[0]:.1f} (queue) vs {medians[1]:.1f} ms (http), "
            f"E2EL {medians[2]:.1f} vs {medians[3]:.1f} ms; median paired difference "
            f"TTFT {statistics.median(dt) * 1e3:+.1f} ms, E2EL {statistics.median(de) * 1e3:+.1f} ms"
        )
        all_ttft += dt
        all_e2el += de
    for name, values in (("TTFT", all_ttft), ("E2EL", all_e2el)):
        q1, q3 = quartiles(values)
        print(
            f"all {len(values)} pairs, http - queue {name}: "
            f"median {statistics.median(values) * 1e3:+.1f} ms, "
            f"interquartile {q1 * 1e3:+.1f} .. {q3 * 1e3:+.1f} ms"
        )


if __name__ == "__main__":
    main()
