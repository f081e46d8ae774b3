"""Pool affinity at internet scale, by simulation (issue 38): 64 workers, 2,000 prefixes of Zipf(1.1)
popularity, a scale-out to 80 and a scale-in to 48, affinity lanes on against off on the same
seeded arrivals. The model and which parts are qworker's real code: tests/pool_emulator/affinity_sim.py.

    .venv/bin/python scripts/simulate_pool_affinity.py --out bench_out/pool_sim.json
    .venv/bin/python scripts/simulate_pool_affinity.py --cache-prefixes 8,16,32,64   # a sweep

Targets: pool-wide prefix hit rate with affinity at least 2x without; lanes moved per scale event
about rendezvous hashing's share (L / N per worker that joins or leaves).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.pool_emulator.affinity_sim import SimConfig, simulate


def _ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{1000 * seconds:,.0f}"


def print_tables(result: dict) -> None:
    on, off = result["on"], result["off"]
    c = result["config"]
    print(
        f"\ncache {c['cache_prefixes']} prefixes/worker, L={c['num_lanes']}, "
        f"steal_after_s={c['steal_after_s']}, seed {c['seed']}: {on['jobs']:,} jobs, "
        f"{on['measured_jobs']:,} measured (from t={c['measure_from_s']:g} s); "
        f"wall {on['wall_s']:.1f} + {off['wall_s']:.1f} s"
    )
    print(
        "| affinity | prefix hit rate | cached share of prompt tokens | prompt tokens computed | jobs stolen "
        "| queue wait p50 / p99 (ms) | TTFT p50 / p99 (ms) |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, r in (("on", on), ("off", off)):
        print(
            f"| {name} (L={r['num_lanes']}) | {100 * r['hit_rate']:.1f}% "
            f"| {100 * r['cached_token_share']:.1f}% "
            f"| {r['prompt_tokens_computed']:,} | {100 * r['stolen_share']:.1f}% "
            f"| {_ms(r['queue_wait_p50_s'])} / {_ms(r['queue_wait_p99_s'])} "
            f"| {_ms(r['ttft_p50_s'])} / {_ms(r['ttft_p99_s'])} |"
        )
    print(
        "\n| phase | workers | hit rate on / off | queue wait p99 on / off (ms) "
        "| 60 s after the event: hit rate on / off |"
    )
    print("|---|---|---|---|---|")
    for i, (p_on, p_off) in enumerate(zip(on["phases"], off["phases"], strict=True)):
        after = ""
        if i > 0:
            a_on, a_off = on["after_scale_events"][i - 1], off["after_scale_events"][i - 1]
            after = f"{100 * a_on['hit_rate']:.1f}% / {100 * a_off['hit_rate']:.1f}%"
        workers = c["phases"][i]["workers"]
        print(
            f"| {p_on['from_s']:g}-{p_on['to_s']:g} s | {workers} | {100 * p_on['hit_rate']:.1f}% / "
            f"{100 * p_off['hit_rate']:.1f}% "
            f"| {_ms(p_on['queue_wait_p99_s'])} / {_ms(p_off['queue_wait_p99_s'])} "
            f"| {after} |"
        )
    print(
        "\n| scale event | live-set changes | lanes moved (sum of changes) | expected (L / N per change) "
        "| net lanes moved (owners before vs after) | expected net (L x k / N) | mean per change / L/N |"
    )
    print("|---|---|---|---|---|---|---|")
    for e in on["scale_events"]:
        per = e["per_change"]
        ratio = sum(ch["lanes_moved"] / ch["expected"] for ch in per) / len(per) if per else float("nan")
        print(
            f"| {e['from']} -> {e['to']} at {e['t']:g} s | {e['live_set_changes']} | {e['lanes_moved']} "
            f"| {e['lanes_moved_expected']:.1f} | {e['lanes_moved_net']} "
            f"| {e['lanes_moved_net_expected']:.1f} "
            f"| {ratio:.2f} |"
        )
    x = on["hit_rate"] / off["hit_rate"]
    print(f"\nhit rate on / off: {x:.2f}x -> {'met' if x >= 2 else 'NOT met'} (target >= 2x)")
    for e in on["scale_events"]:
        r = e["lanes_moved"] / e["lanes_moved_expected"]
        print(
            f"lanes moved {e['from']} -> {e['to']}: {r:.2f}x rendezvous hashing's expectation "
            f"-> {'met' if 0.75 <= r <= 1.25 else 'NOT met'} (target: about 1/N per change, within 25%)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--cache-prefixes", default="16", help="per-worker LRU capacity(ies), comma-separated"
    )
    parser.add_argument("--lanes", type=int, default=SimConfig.num_lanes)
    parser.add_argument("--steal-after-s", type=float, default=SimConfig.steal_after_s)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write every result as JSON here")
    args = parser.parse_args()
    results = []
    for capacity in (int(x) for x in args.cache_prefixes.split(",")):
        config = replace(
            SimConfig(),
            cache_prefixes=capacity,
            num_lanes=args.lanes,
            steal_after_s=args.steal_after_s,
            seed=args.seed,
        )
        result = simulate(config)
        print_tables(result)
        results.append(result)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
