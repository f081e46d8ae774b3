"""PNG plots of a sweep: latency CDFs per rate, throughput and p99 TTFT against rate, KV blocks
in use over time. matplotlib draws off-screen (Agg); it is imported only here."""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "_", text).strip("_")


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plain_log_ticks(axis: Any) -> None:
    """Plain numbers at 1-2-5 steps on a log axis (0.5, 2, 10), not 5x10^-1."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def _completed(run: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in run["records"] if r["status"] == "completed"]


def _ttfts_s(run: dict[str, Any]) -> list[float]:
    return [r["chunk_times"][0] - r["arrival_time"] for r in _completed(run) if r["chunk_times"]]


def _itls_ms(run: dict[str, Any]) -> list[float]:
    return [1000.0 * (b - a) for r in _completed(run) for a, b in itertools.pairwise(r["chunk_times"])]


def _e2els_s(run: dict[str, Any]) -> list[float]:
    return [r["finish_time"] - r["arrival_time"] for r in _completed(run)]


def _cdf(ax: Any, values: Sequence[float], label: str, color: Any) -> None:
    if not len(values):
        # Still in the legend, so that a system with nothing completed is not silently missing.
        ax.plot([], [], label=label, color=color, linestyle=":")
        return
    xs = np.sort(np.asarray(values, dtype=np.float64))
    # Log axes cannot show 0; a gap below a microsecond is a measurement floor anyway.
    xs = np.maximum(xs, 1e-6)
    ys = np.arange(1, len(xs) + 1) / len(xs)
    ax.step(xs, ys, where="post", label=label, color=color)


def plot_latency_cdfs(runs: Sequence[dict[str, Any]], rate_label: str, workload: str, path: Path) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    panels = [
        ("TTFT (s)", _ttfts_s, "fraction of requests"),
        ("ITL (ms)", _itls_ms, "fraction of token gaps"),
        ("E2E latency (s)", _e2els_s, "fraction of requests"),
    ]
    colors = plt.get_cmap("tab10")
    for ax, (xlabel, values_of, ylabel) in zip(axes, panels, strict=True):
        for i, run in enumerate(runs):
            s = run["summary"]
            label = f"{run['name']} ({s['completed']}/{s['num_prompts']} completed)"
            _cdf(ax, values_of(run), label, colors(i % 10))
        ax.set_xscale("log")
        _plain_log_ticks(ax.xaxis)
        ax.set_xlabel(xlabel + ", log scale")
        ax.set_ylabel(ylabel)
        ax.set_ylim(0, 1.02)
        ax.grid(True, which="both", alpha=0.3)
        for y in (0.5, 0.99):
            ax.axhline(y, color="grey", linewidth=0.6, linestyle=":")
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend(loc="best", fontsize=8)
    else:
        axes[0].text(0.5, 0.5, "no completed requests", transform=axes[0].transAxes, ha="center")
    fig.suptitle(f"{workload} @ {rate_label}: latency CDFs (completed requests; dotted lines at p50 and p99)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_rate_sweep(runs: Sequence[dict[str, Any]], sustain_ttft_s: float, workload: str, path: Path) -> None:
    plt = _pyplot()
    fig, (ax_tp, ax_ttft) = plt.subplots(1, 2, figsize=(13, 4.8))
    colors = plt.get_cmap("tab10")
    names = list(dict.fromkeys(r["name"] for r in runs))
    for i, name in enumerate(names):
        points = sorted(
            (r for r in runs if r["name"] == name and r["rate"] is not None), key=lambda r: r["rate"]
        )
        if not points:
            continue
        rates = [r["rate"] for r in points]
        throughput = [r["summary"]["output_throughput"] for r in points]
        p99 = [(r["summary"]["p99_ttft_ms"] or float("nan")) / 1000.0 for r in points]
        clean = [r["summary"]["failed"] == 0 for r in points]
        color = colors(i % 10)
        ax_tp.plot(rates, throughput, marker="o", color=color, label=name)
        ax_ttft.plot(rates, p99, marker="o", color=color, label=name)
        # Runs with failures or timeouts: a red ring, since their latencies cover survivors only.
        bad = [j for j, ok in enumerate(clean) if not ok]
        if bad:
            ax_tp.scatter(
                [rates[j] for j in bad],
                [throughput[j] for j in bad],
                s=140,
                facecolors="none",
                edgecolors="red",
                linewidths=1.5,
                zorder=5,
            )
            ax_ttft.scatter(
                [rates[j] for j in bad],
                [p99[j] for j in bad],
                s=140,
                facecolors="none",
                edgecolors="red",
                linewidths=1.5,
                zorder=5,
            )
    ax_tp.set_xlabel("request rate (requests/s), log scale")
    ax_tp.set_ylabel("output throughput (tokens/s)")
    ax_tp.set_title("Output throughput against offered rate")
    ax_ttft.set_xlabel("request rate (requests/s), log scale")
    ax_ttft.set_ylabel("p99 TTFT (s), log scale")
    ax_ttft.set_yscale("log")
    _plain_log_ticks(ax_ttft.yaxis)
    # Rate sweeps are usually geometric (0.5, 1, 2, 4): log2 rate axes, a tick at each rate.
    from matplotlib.ticker import FuncFormatter, NullFormatter

    all_rates = sorted({r["rate"] for r in runs if r["rate"] is not None})
    for ax in (ax_tp, ax_ttft):
        ax.set_xscale("log", base=2)
        ax.set_xticks(all_rates)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
    ax_ttft.axhline(
        sustain_ttft_s, color="grey", linestyle="--", linewidth=1, label=f"{sustain_ttft_s:g} s target"
    )
    ax_ttft.set_title("p99 time to first token against offered rate")
    for ax in (ax_tp, ax_ttft):
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(f"{workload}: rate sweep (red rings: runs with failed or timed-out requests)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_kv_blocks(runs: Sequence[dict[str, Any]], workload: str, path: Path) -> None:
    plt = _pyplot()
    rate_labels = list(dict.fromkeys(r["rate_label"] for r in runs))
    fig, axes = plt.subplots(len(rate_labels), 1, figsize=(11, 3.8 * len(rate_labels)), squeeze=False)
    colors = plt.get_cmap("tab10")
    names = list(dict.fromkeys(r["name"] for r in runs))
    for ax, rate_label in zip(axes[:, 0], rate_labels, strict=True):
        totals = set()
        for run in (r for r in runs if r["rate_label"] == rate_label):
            timeline = run["kv_timeline"]
            if not timeline:
                continue
            color = colors(names.index(run["name"]) % 10)
            t = [s["t"] for s in timeline]
            block_size = timeline[0]["block_size"]
            # Steps: the cache holds its state from one engine step to the next (or through idle time).
            ax.plot(
                t,
                [s["num_used_blocks"] for s in timeline],
                drawstyle="steps-post",
                color=color,
                label=f"{run['name']}: paged blocks in use",
            )
            ax.plot(
                t,
                [s["num_contiguous_slots"] / block_size for s in timeline],
                drawstyle="steps-post",
                color=color,
                linestyle="--",
                alpha=0.7,
                label=f"{run['name']}: contiguous prompt+max_tokens reservation (in blocks)",
            )
            totals.add(timeline[0]["num_total_blocks"])
        ax.set_xlabel("time since the run started (s)")
        ax.set_ylabel("KV blocks")
        total_text = ", ".join(str(t) for t in sorted(totals))
        ax.set_title(f"{workload} @ {rate_label}: KV blocks in use (pool: {total_text} blocks)")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        # Outside the axes: inside, it would cover the busiest part of the timeline.
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def make_plots(payload: dict[str, Any], out_dir: Path) -> list[str]:
    """Render every plot the runs support; returns the file names written."""
    runs = payload["runs"]
    workload = payload["workload"]["name"]
    files: list[str] = []
    rate_labels = list(dict.fromkeys(r["rate_label"] for r in runs))
    for rate_label in rate_labels:
        path = out_dir / (
            "latency_cdf.png" if len(rate_labels) == 1 else f"latency_cdf_{_slug(rate_label)}.png"
        )
        plot_latency_cdfs([r for r in runs if r["rate_label"] == rate_label], rate_label, workload, path)
        files.append(path.name)
    finite_rates = {r["rate"] for r in runs if r["rate"] is not None}
    if len(finite_rates) > 1:
        path = out_dir / "rate_sweep.png"
        plot_rate_sweep(runs, payload["meta"]["sustain_ttft_s"], workload, path)
        files.append(path.name)
    kv_runs = [r for r in runs if r.get("kv_timeline")]
    if kv_runs:
        path = out_dir / "kv_blocks.png"
        plot_kv_blocks(kv_runs, workload, path)
        files.append(path.name)
    return files
