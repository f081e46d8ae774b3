"""results.json and report.md from a finished sweep: tables, ratios against the baseline measured
in the same run, and the saturation rate of each system."""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# The rate at which p99 TTFT "breaks" in the saturation table (seconds).
BREAK_TTFT_S = 10.0


def format_number(value: Any, digits: int = 1) -> str:
    """A table cell: `digits` decimals below 100, thousands separators above, – for None."""
    if value is None:
        return "–"
    if isinstance(value, float):
        if math.isinf(value) or math.isnan(value):
            return str(value)
        if abs(value) >= 100:
            return f"{value:,.0f}"
        return f"{value:.{digits}f}"
    return str(value)


def _ms_pair(summary: dict[str, Any], metric: str, stats: Sequence[str]) -> str:
    return " / ".join(format_number(summary.get(f"{s}_{metric}_ms")) for s in stats)


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """A markdown table's lines (cells already formatted)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def is_clean(summary: dict[str, Any]) -> bool:
    return summary["failed"] == 0


def comparisons(runs: Sequence[dict[str, Any]], baseline: str | None) -> list[dict[str, Any]]:
    """Each run against the baseline's engine-mode run at the same rate (same requests)."""
    if baseline is None:
        return []
    base_by_rate = {r["rate_label"]: r for r in runs if r["system"] == baseline and r["mode"] == "engine"}
    out = []
    for run in runs:
        base = base_by_rate.get(run["rate_label"])
        if base is None or run is base:
            continue
        s, b = run["summary"], base["summary"]
        out.append(
            {
                "name": run["name"],
                "baseline": base["name"],
                "rate_label": run["rate_label"],
                "output_throughput_x": _ratio(s["output_throughput"], b["output_throughput"]),
                "request_throughput_x": _ratio(s["request_throughput"], b["request_throughput"]),
                # Latency ratios are baseline / system: above 1 means the system is faster.
                "p99_ttft_speedup": _ratio(b["p99_ttft_ms"], s["p99_ttft_ms"]),
                "p99_itl_speedup": _ratio(b["p99_itl_ms"], s["p99_itl_ms"]),
                "p99_e2el_speedup": _ratio(b["p99_e2el_ms"], s["p99_e2el_ms"]),
                "both_clean": is_clean(s) and is_clean(b),
            }
        )
    return out


def throughput_ratios(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every pair of engine-mode runs at the same rate: output tok/s of one over the other's, each
    pair once, in the order the systems ran (the first named system over the later ones)."""
    by_rate: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        if run["mode"] == "engine":
            by_rate.setdefault(run["rate_label"], []).append(run)
    out = []
    for rate_label, rate_runs in by_rate.items():
        for i, run in enumerate(rate_runs):
            for other in rate_runs[i + 1 :]:
                ratio = _ratio(run["summary"]["output_throughput"], other["summary"]["output_throughput"])
                if ratio is None:
                    continue
                out.append(
                    {
                        "name": run["name"],
                        "other": other["name"],
                        "rate_label": rate_label,
                        "output_throughput_x": ratio,
                        "both_clean": is_clean(run["summary"]) and is_clean(other["summary"]),
                    }
                )
    return out


def pool_base(runs: Sequence[dict[str, Any]], run: dict[str, Any], baseline: str | None) -> dict[str, Any]:
    """The run a pool run is compared with: the baseline system's run in the same mode and rate,
    else the first run with pool figures at that rate."""
    same = [r for r in runs if r["mode"] == run["mode"] and r["rate_label"] == run["rate_label"]]
    named = next((r for r in same if r["system"] == baseline), None)
    return named or next(r for r in same if r.get("pool"))


def pool_lines(runs: Sequence[dict[str, Any]], baseline: str | None, pkey: str = "p99") -> list[str]:
    """The pool table (qworker/bench/pool_stats.py): what each queue run's workers computed."""
    pool_runs = [r for r in runs if r.get("pool")]
    if not pool_runs:
        return []
    rows = []
    for r in pool_runs:
        p, s = r["pool"], r["summary"]
        base = pool_base(runs, r, baseline)
        per_worker = "; ".join(
            f"{format_number(100 * w['hit_rate'])}% ({w['completed']})"
            for w in p["workers"].values()
            if w["hit_rate"] is not None
        )
        rows.append(
            [
                r["name"],
                r["rate_label"],
                format_number(s["output_throughput"]),
                format_number(_ratio(s["output_throughput"], base["summary"]["output_throughput"]), 2),
                f"{p['prompt_tokens_computed']:,}",
                f"{p['ideal_prompt_tokens_computed']:,}" if p["ideal_prompt_tokens_computed"] else "–",
                format_number(p["computed_over_ideal"], 2),
                format_number(100 * p["hit_rate"]) + "%" if p["hit_rate"] is not None else "–",
                per_worker,
                _ms_pair(s, "ttft", ["median", pkey]),
                format_number(s.get(f"{pkey}_queue_wait_ms")),
            ]
        )
    lines = [
        "",
        "## Pool",
        "",
        "From each job's stored result: `usage.prompt_tokens_details.cached_tokens` (prompt tokens "
        "its worker's prefix cache held) and `worker`. Computed = prompt tokens - cached tokens, over "
        "the pool; the ideal is one shared cache that never forgets (each shared run of whole KV "
        "blocks computed once). Ratios are against the baseline system's run in the same mode, else "
        "the first run in this table at that rate.",
        "",
    ]
    lines += markdown_table(
        [
            "system",
            "rate",
            "output tok/s",
            "÷ base",
            "prompt tokens computed",
            "ideal",
            "computed ÷ ideal",
            "hit rate (pool)",
            "hit rate per worker (jobs)",
            f"TTFT median / {pkey} (ms)",
            f"queue wait {pkey} (ms)",
        ],
        rows,
    )
    return lines


def _compute_limit_lines(limit: dict[str, Any], runs: Sequence[dict[str, Any]]) -> list[str]:
    max_tput = limit["max_output_throughput"]
    lines = [
        "",
        "## Compute limit",
        "",
        f"The workload's linear-layer matmuls ({limit['flops'] / 1e12:.2f} TFLOP: "
        f"{limit['schedule']['num_forward_tokens']:,} tokens through the decoder, the lm_head on "
        f"{limit['schedule']['num_sampled_tokens']:,} sampled positions) take {limit['seconds']:.1f} s at "
        f"the rates `F.linear` reached in this run ({limit['dtype']}, {limit['torch_threads']} threads, "
        "best of 5, at each step's row count of the whole request set run together): no engine makes "
        f"more than **{format_number(max_tput)} output tok/s** on these requests.",
        "",
    ]
    rows = [
        [
            r["name"],
            format_number(r["summary"]["output_throughput"]),
            format_number(100 * r["summary"]["output_throughput"] / max_tput) + "%",
        ]
        for r in runs
        if r["rate_label"] == limit["rate_label"]
    ]
    lines += markdown_table(["system", "output tok/s", "of the compute limit"], rows)
    by_rows: dict[int, dict[str, float]] = {}
    shapes: list[str] = []
    for point in limit["rates"]:
        by_rows.setdefault(point["rows"], {})[point["shape"]] = point["tflops"]
        if point["shape"] not in shapes:
            shapes.append(point["shape"])
    lines += ["", "Measured matmul rates (TFLOP/s) by rows:", ""]
    lines += markdown_table(
        ["rows", *shapes],
        [[str(n), *(format_number(by_rows[n].get(s), 3) for s in shapes)] for n in sorted(by_rows)],
    )
    return lines


def saturation(runs: Sequence[dict[str, Any]], sustain_ttft_s: float) -> list[dict[str, Any]]:
    """Per system: the highest rate (going up from the lowest) it sustained, meaning every
    request completed and p99 TTFT <= sustain_ttft_s, and the first rate where p99 TTFT passed
    BREAK_TTFT_S. Only finite rates count."""
    by_name: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        if run["rate"] is not None:
            by_name.setdefault(run["name"], []).append(run)
    out = []
    for name, system_runs in by_name.items():
        system_runs.sort(key=lambda r: r["rate"])
        sustained = None
        for run in system_runs:
            s = run["summary"]
            p99 = s["p99_ttft_ms"]
            if is_clean(s) and p99 is not None and p99 <= sustain_ttft_s * 1000:
                sustained = run["rate"]
            else:
                break
        broke = next(
            (
                r["rate"]
                for r in system_runs
                if not is_clean(r["summary"])
                or r["summary"]["p99_ttft_ms"] is None
                or r["summary"]["p99_ttft_ms"] > BREAK_TTFT_S * 1000
            ),
            None,
        )
        out.append(
            {
                "name": name,
                "rates": [r["rate"] for r in system_runs],
                "max_sustained_rate": sustained,
                "sustain_ttft_s": sustain_ttft_s,
                "first_rate_p99_ttft_over_break": broke,
                "break_ttft_s": BREAK_TTFT_S,
            }
        )
    return out


def write_results_json(path: Path, payload: dict[str, Any]) -> None:
    def default(value: Any) -> Any:
        if isinstance(value, Path):
            return str(value)
        raise TypeError(f"cannot write {type(value).__name__} to results.json")

    # allow_nan=False: a NaN or inf sneaking into results.json is a bug to see, not to ship.
    path.write_text(json.dumps(payload, indent=1, default=default, allow_nan=False))


def _error_lines(runs: Sequence[dict[str, Any]]) -> list[str]:
    lines = []
    for run in runs:
        errors = Counter(
            f"{rec['status']}: {rec['error'] or 'no message'}"
            for rec in run["records"]
            if rec["status"] != "completed"
        )
        for message, count in errors.most_common():
            lines.append(f"- {run['name']} @ {run['rate_label']}: {count} × {message}")
    return lines


def render_report_md(payload: dict[str, Any], plot_files: Sequence[str]) -> str:
    runs = payload["runs"]
    meta = payload["meta"]
    workload = payload["workload"]
    percentiles = meta["percentiles"]
    pkeys = [f"p{int(p)}" if float(p).is_integer() else f"p{p}" for p in percentiles]
    lines = [f"# Benchmark report: {workload['name']}", ""]
    if workload.get("about"):
        lines += [f"> {workload['about']}", ""]
    host = meta["host"]
    lines += [
        f"Run {meta['created_at']} on {host['platform']} ({host['cpu_count']} CPUs, torch "
        f"{host['torch_version']}, {host['torch_threads']} threads). Command: `{meta['command']}`",
        "",
        f"CPU: {host.get('cpu_model') or 'unknown'}; flags: "
        f"{', '.join(host.get('cpu_flags') or []) or 'none of avx2/avx512/amx'}.",
        "",
        "Timestamps are taken where tokens appear (engine mode: after each engine step; queue mode: "
        "on the client as deltas arrive). Latency statistics cover completed requests; `failed` "
        "counts every request that did not complete, `timeout` the part of it that ran out of time.",
        "",
        "## Request sets",
        "",
    ]
    rows = [
        [
            rs["rate_label"],
            str(rs["num_requests"]),
            format_number(rs["mean_prompt_len"]),
            str(rs["max_prompt_len"]),
            format_number(rs["mean_output_len"]),
            str(rs["max_output_len"]),
            format_number(rs["last_arrival_s"]),
            f"`{rs['sha256'][:16]}`",
            f"`{rs['sha256_without_arrivals'][:16]}`",
        ]
        for rs in payload["request_sets"]
    ]
    lines += markdown_table(
        [
            "rate",
            "requests",
            "mean prompt",
            "max prompt",
            "mean output",
            "max output",
            "last arrival (s)",
            "sha256",
            "sha256 w/o arrivals",
        ],
        rows,
    )
    lines += ["", "## Results", ""]
    slo = meta.get("slo") or {}
    header = [
        "system",
        "rate",
        "completed",
        "failed (timeout)",
        "req/s",
        "output tok/s",
        "total tok/s",
        f"TTFT mean / median / {' / '.join(pkeys)} (ms)",
        f"TPOT median / {pkeys[-1]} (ms)",
        f"ITL median / {pkeys[-1]} (ms)",
        f"E2EL median / {pkeys[-1]} (ms)",
    ]
    if slo:
        header.append("goodput (req/s)")
    rows = []
    for run in runs:
        s = run["summary"]
        row = [
            run["name"],
            run["rate_label"],
            f"{s['completed']}/{s['num_prompts']}",
            f"{s['failed']} ({s['timed_out']})",
            format_number(s["request_throughput"], 2),
            format_number(s["output_throughput"]),
            format_number(s["total_token_throughput"]),
            _ms_pair(s, "ttft", ["mean", "median", *pkeys]),
            _ms_pair(s, "tpot", ["median", pkeys[-1]]),
            _ms_pair(s, "itl", ["median", pkeys[-1]]),
            _ms_pair(s, "e2el", ["median", pkeys[-1]]),
        ]
        if slo:
            row.append(format_number(s.get("request_goodput"), 2))
        rows.append(row)
    lines += markdown_table(header, rows)
    if slo:
        lines += ["", "Goodput SLOs: " + ", ".join(f"{k} ≤ {v:g}" for k, v in slo.items()) + "."]

    comps = payload.get("comparisons") or []
    if comps:
        lines += [
            "",
            f"## Against the baseline ({meta['baseline']}), same rate, same requests",
            "",
            "Throughput: system ÷ baseline. Latency: baseline ÷ system (above 1: the system is faster). "
            "A ratio involving a run with failures is marked *; its latencies cover completed requests only.",
            "",
        ]
        rows = [
            [
                c["name"],
                c["rate_label"],
                format_number(c["output_throughput_x"], 2) + ("" if c["both_clean"] else " *"),
                format_number(c["request_throughput_x"], 2),
                format_number(c["p99_ttft_speedup"], 2),
                format_number(c["p99_itl_speedup"], 2),
                format_number(c["p99_e2el_speedup"], 2),
            ]
            for c in comps
        ]
        lines += markdown_table(
            ["system", "rate", "output tok/s ×", "req/s ×", "p99 TTFT ×", "p99 ITL ×", "p99 E2EL ×"], rows
        )

    ratios = throughput_ratios(runs)
    if ratios:
        lines += ["", "## Output throughput ratios, same rate, same requests", ""]
        lines += markdown_table(
            ["system", "against", "rate", "output tok/s ×"],
            [
                [
                    r["name"],
                    r["other"],
                    r["rate_label"],
                    format_number(r["output_throughput_x"], 2) + ("" if r["both_clean"] else " *"),
                ]
                for r in ratios
            ],
        )
    if payload.get("compute_limit"):
        lines += _compute_limit_lines(payload["compute_limit"], runs)

    sat = payload.get("saturation") or []
    if sat and any(len(s["rates"]) > 1 for s in sat):
        threshold = sat[0]["sustain_ttft_s"]
        lines += [
            "",
            "## Saturation",
            "",
            f"Sustained: the highest rate, going up the sweep, at which every request completed with "
            f"p99 TTFT ≤ {threshold:g} s. Breaks: the first rate with p99 TTFT > {BREAK_TTFT_S:g} s "
            "or any failure.",
            "",
        ]
        rows = [
            [
                s["name"],
                ", ".join(f"{r:g}" for r in s["rates"]),
                format_number(s["max_sustained_rate"], 2) if s["max_sustained_rate"] is not None else "none",
                format_number(s["first_rate_p99_ttft_over_break"], 2)
                if s["first_rate_p99_ttft_over_break"] is not None
                else "not within the sweep",
            ]
            for s in sat
        ]
        lines += markdown_table(["system", "rates (req/s)", "sustained (req/s)", "breaks at (req/s)"], rows)
        base = next((s for s in sat if s["name"] == meta.get("baseline")), None)
        if base is not None:
            for s in sat:
                if s is base:
                    continue
                ratio = _ratio(s["max_sustained_rate"], base["max_sustained_rate"])
                lines.append("")
                lines.append(
                    f"{s['name']} sustains {format_number(ratio, 2)}× the rate {base['name']} sustains."
                    if ratio is not None
                    else f"{s['name']} against {base['name']}: no ratio (one of them sustained no rate "
                    "in this sweep)."
                )

    kv_runs = [r for r in runs if r.get("kv")]
    if kv_runs:
        lines += [
            "",
            "## KV cache",
            "",
            "Waste is reserved-but-empty slots over reserved slots, summed over engine steps. Paged: the "
            "empty tail of each request's last block. Contiguous: reserving prompt + max_tokens per "
            "running request up front. max_model_len: reserving the whole context per request. "
            "Peak blocks used counts blocks some request holds (a shared prefix block once). Prefill "
            "tokens computed: prompt tokens the model ran (prefix-cache hits excluded).",
            "",
        ]
        rows = []
        for run in kv_runs:
            kv = run["kv"]
            rows.append(
                [
                    run["name"],
                    run["rate_label"],
                    f"{kv['peak_kv_blocks_used']} / {kv['num_total_kv_blocks']} "
                    f"({format_number(kv['peak_kv_usage_pct'])}%)",
                    str(kv["peak_num_running"]),
                    format_number(kv["kv_waste_pct"], 2),
                    format_number(kv["contiguous_waste_pct"]),
                    format_number(kv["max_model_len_waste_pct"]),
                    format_number(kv["contiguous_to_paged_slots"], 2),
                    str(kv["num_preemptions"]),
                    str(run["meta"].get("num_prompt_tokens_computed", "n/a")),
                    str(run["meta"].get("num_prefix_cache_hit_tokens", "n/a")),
                ]
            )
        lines += markdown_table(
            [
                "system",
                "rate",
                "peak blocks used / total",
                "peak running",
                "paged waste %",
                "contiguous waste %",
                "max_model_len waste %",
                "contiguous ÷ paged slots",
                "preemptions",
                "prefill tokens computed",
                "prefix-cache hit tokens",
            ],
            rows,
        )

    queue_runs = [r for r in runs if r["summary"].get("median_queue_wait_ms") is not None]
    if queue_runs:
        lines += ["", "## Queue", ""]
        rows = [
            [
                r["name"],
                r["rate_label"],
                _ms_pair(r["summary"], "queue_wait", ["mean", "median", pkeys[-1]]),
            ]
            for r in queue_runs
        ]
        lines += markdown_table(["system", "rate", f"queue wait mean / median / {pkeys[-1]} (ms)"], rows)
        engine_by_key = {(r["system"], r["rate_label"]): r for r in runs if r["mode"] == "engine"}
        pairs = [(q, engine_by_key.get((q["system"], q["rate_label"]))) for q in runs if q["mode"] == "queue"]
        pair_rows = []
        for q, e in pairs:
            if e is None:
                continue
            qs, es = q["summary"], e["summary"]
            pair_rows.append(
                [
                    q["system"],
                    q["rate_label"],
                    format_number(_ratio(qs["output_throughput"], es["output_throughput"]), 2),
                    format_number(_diff(qs["median_ttft_ms"], es["median_ttft_ms"])),
                    format_number(_diff(qs["p99_ttft_ms"], es["p99_ttft_ms"])),
                    format_number(_diff(qs["median_itl_ms"], es["median_itl_ms"])),
                ]
            )
        if pair_rows:
            lines += ["", "What the queue costs (queue mode against engine mode, same requests):", ""]
            lines += markdown_table(
                [
                    "system",
                    "rate",
                    "output tok/s (queue ÷ engine)",
                    "median TTFT + (ms)",
                    f"{pkeys[-1]} TTFT + (ms)",
                    "median ITL + (ms)",
                ],
                pair_rows,
            )

    lines += pool_lines(runs, meta.get("baseline"), pkeys[-1])

    errors = _error_lines(runs)
    lines += ["", "## Failures and timeouts", ""]
    lines += errors or ["None: every request of every run completed."]
    notes = list(payload.get("notes") or [])
    threads = {(r["meta"].get("torch_threads"), r["meta"].get("num_cpus_usable")) for r in runs}
    if len(threads) > 1:
        per_run = ", ".join(
            f"{r['name']}: {r['meta'].get('torch_threads')} threads, {r['meta'].get('num_cpus_usable')} CPUs"
            for r in runs
        )
        notes.append(f"Runs did not all have the same torch threads / usable CPUs ({per_run}).")
    if notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    if plot_files:
        lines += ["", "## Plots", ""]
        lines += [f"![{Path(f).stem}]({Path(f).name})" for f in plot_files]
    return "\n".join(lines) + "\n"
