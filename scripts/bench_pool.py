"""Pool affinity through real workers (issue 38): `qworker bench` in queue mode with a pool of
workers, affinity lanes on against off, in one run each way and again in the other order, on
`pool-prefixes` (P distinct 1,024-token prefixes, interleaved) and on `offline-mixed` (no shared
prefixes: what the lanes cost). A thin driver: each leg is one `qworker bench` command (printed
before it runs), and this script only reads their results.json files and checks the targets.

    .venv/bin/python scripts/bench_pool.py --out bench_out/pool_affinity

Targets (docs/BENCHMARKS.md, "Pool affinity (issue 38)"): on pool-prefixes, affinity on computes
at most 1.25x the ideal prompt tokens (each prefix once plus every suffix) and makes at least 1.5x
the output tok/s of affinity off; on offline-mixed, affinity on is within 3% of off in output
tok/s and within 10% in p99 queue wait. Ratios are taken within one command (the two pools run one
after the other on the same requests), never across commands.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def bench_command(args: argparse.Namespace, workload: str, first: str, second: str, out: Path) -> list[str]:
    command = [
        sys.executable,
        *("-m", "qworker.cli", "bench", "--workload", workload, "--mode", "queue"),
        *("--systems", f"{first},{second}", "--baseline", off_system(args)),
        *("--workers", str(args.workers), "--worker-threads", str(args.worker_threads)),
        *("--no-compute-limit", "--no-plots", "--no-progress", "--out", str(out)),
        *("--drain-timeout-s", str(args.drain_timeout_s)),
    ]
    if workload == "pool-prefixes":
        command += ["--num-kv-blocks", str(args.num_kv_blocks), "--num-requests", str(args.num_requests)]
    else:
        command += ["--num-requests", str(args.mixed_requests)]
    return command


def on_system(args: argparse.Namespace) -> str:
    return f"qworker:affinity_lanes={args.lanes}"


def off_system(args: argparse.Namespace) -> str:
    return "qworker:affinity_lanes=1"


def leg_summary(results: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """On against off within one command's results."""
    by_system = {r["system"]: r for r in results["runs"]}
    on, off = by_system[on_system(args)], by_system[off_system(args)]
    out: dict[str, Any] = {"order": [r["system"] for r in results["runs"]]}
    for name, run in (("on", on), ("off", off)):
        s, p = run["summary"], run["pool"] or {}
        out[name] = {
            "output_tok_s": s["output_throughput"],
            "completed": s["completed"],
            "num_prompts": s["num_prompts"],
            "duration_s": s["duration"],
            "prompt_tokens_computed": p.get("prompt_tokens_computed"),
            "ideal_prompt_tokens_computed": p.get("ideal_prompt_tokens_computed"),
            "computed_over_ideal": p.get("computed_over_ideal"),
            "hit_rate": p.get("hit_rate"),
            "workers": {
                w.rsplit("-", 1)[-1]: {"jobs": v["completed"], "hit_rate": v["hit_rate"]}
                for w, v in (p.get("workers") or {}).items()
            },
            "ttft_p50_ms": s["median_ttft_ms"],
            "ttft_p99_ms": s["p99_ttft_ms"],
            "queue_wait_p99_ms": s.get("p99_queue_wait_ms"),
        }
    out["throughput_on_over_off"] = on["summary"]["output_throughput"] / off["summary"]["output_throughput"]
    wait_on, wait_off = out["on"]["queue_wait_p99_ms"], out["off"]["queue_wait_p99_ms"]
    out["queue_wait_p99_on_over_off"] = wait_on / wait_off if wait_on and wait_off else None
    out["load_average"] = results["meta"]["host"].get("load_average")
    return out


def targets(legs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for name, leg in legs.items():
        if name.startswith("pool-prefixes"):
            over = leg["on"]["computed_over_ideal"]
            rows.append(
                {
                    "leg": name,
                    "target": "computed <= 1.25x ideal (on)",
                    "value": over,
                    "met": over is not None and over <= 1.25,
                }
            )
            x = leg["throughput_on_over_off"]
            rows.append({"leg": name, "target": "output tok/s on >= 1.5x off", "value": x, "met": x >= 1.5})
        else:
            x = leg["throughput_on_over_off"]
            rows.append(
                {
                    "leg": name,
                    "target": "output tok/s on within 3% of off",
                    "value": x,
                    "met": abs(x - 1) <= 0.03,
                }
            )
            w = leg["queue_wait_p99_on_over_off"]
            rows.append(
                {
                    "leg": name,
                    "target": "p99 queue wait on within 10% of off",
                    "value": w,
                    "met": w is not None and abs(w - 1) <= 0.10,
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("bench_out/pool_affinity"))
    parser.add_argument("--lanes", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--worker-threads", type=int, default=1)
    parser.add_argument("--num-kv-blocks", type=int, default=320)
    parser.add_argument("--num-requests", type=int, default=48, help="pool-prefixes requests")
    parser.add_argument("--mixed-requests", type=int, default=32, help="offline-mixed requests")
    parser.add_argument("--drain-timeout-s", type=float, default=900.0)
    parser.add_argument("--workloads", default="pool-prefixes,offline-mixed")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    legs: dict[str, dict[str, Any]] = {}
    commands: dict[str, str] = {}
    for workload in args.workloads.split(","):
        for tag, first, second in (
            ("on-off", on_system(args), off_system(args)),
            ("off-on", off_system(args), on_system(args)),
        ):
            name = f"{workload}.{tag}"
            out = args.out / name
            command = bench_command(args, workload, first, second, out)
            commands[name] = shlex.join(["qworker", *command[3:]])
            print(f"$ {commands[name]}", flush=True)
            started = time.monotonic()
            subprocess.run(command, check=True)
            print(f"  ({time.monotonic() - started:.0f} s)", flush=True)
            legs[name] = leg_summary(json.loads((out / "results.json").read_text()), args)
    rows = targets(legs)
    summary = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "commands": commands,
        "legs": legs,
        "targets": rows,
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    for name, leg in legs.items():
        print(f"{name}: order {leg['order']}")
        for side in ("on", "off"):
            s = leg[side]
            print(
                f"  {side:>3}: {s['output_tok_s']:6.1f} tok/s, computed {s['prompt_tokens_computed']:,} "
                f"({(s['computed_over_ideal'] or 0):.2f}x ideal), hit {100 * (s['hit_rate'] or 0):.1f}% "
                f"{s['workers']}, TTFT p50/p99 {s['ttft_p50_ms']:.0f}/{s['ttft_p99_ms']:.0f} ms, "
                f"queue wait p99 {s['queue_wait_p99_ms']:.0f} ms"
            )
    for row in rows:
        print(f"{row['leg']}: {row['target']}: {row['value']:.3f} -> {'met' if row['met'] else 'NOT met'}")


if __name__ == "__main__":
    main()
