"""The `qworker` command (also `python -m qworker`): worker, submit, demo, and bench (qworker.bench)."""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from qworker import envs
from qworker.batch.command import batch
from qworker.bench.command import bench
from qworker.cli_errors import (
    connecting,
    reported_errors,
)
from qworker.cli_options import config_options, engine_options, worker_options
from qworker.config import EngineConfig
from qworker.pool.demand import PoolSizing
from qworker.pool.exporter import DEFAULT_EXPORTER_PORT, DEFAULT_INTERVAL_S
from qworker.worker.settings import WorkerSettings

if TYPE_CHECKING:
    from qworker.backends.dead_letters import DeadLetterQueue

# Plain click help, not typer's rich panels: rich crops option names to fit its table
# ("--max-num-batched-to…") on narrow terminals and, off a terminal, at 80 columns. Click's
# formatter never cuts an option name; it moves the help text to the next line instead.
HELP_WIDTH = 120

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Queue-driven LLM inference worker.",
    rich_markup_mode=None,
    context_settings={"max_content_width": HELP_WIDTH},
)

# URLs may carry passwords: from the environment or a file they stay out of the process list.
QUEUE_URL_ENV = envs.QWORKER_QUEUE_URL.name
RESULTS_URL_ENV = envs.QWORKER_RESULTS_URL.name
STATS_URL_ENV = envs.QWORKER_STATS_URL.name

QueueOpt = Annotated[
    str | None,
    typer.Option(
        envvar=QUEUE_URL_ENV,
        help="Queue URL, e.g. redis://127.0.0.1:6379/0?stream=jobs, "
        f"or ${QUEUE_URL_ENV} (none: embedded Redis)",
    ),
]
ResultsOpt = Annotated[
    str | None,
    typer.Option(
        envvar=RESULTS_URL_ENV,
        help="Results URL: redis://, s3://bucket/prefix, celery+redis://, "
        f"or ${RESULTS_URL_ENV} (none: the queue server)",
    ),
]
QueueFileOpt = Annotated[
    Path | None,
    typer.Option(help="Read the queue URL from this file (e.g. a mounted Secret) instead of --queue"),
]
ResultsFileOpt = Annotated[
    Path | None,
    typer.Option(help="Read the results URL from this file instead of --results"),
]


def url_from(value: str | None, path: Path | None, option: str) -> str | None:
    """The URL an option or its --*-url-file gives; both at once is a usage error."""
    if path is None:
        return value
    if value is not None:
        raise typer.BadParameter(
            f"give {option} (or its environment variable) or {option}-url-file, not both"
        )
    try:
        text = path.read_text().strip()
    except OSError as exc:
        raise typer.BadParameter(f"cannot read {option}-url-file {path}: {exc}") from None
    if not text:
        raise typer.BadParameter(f"{option}-url-file {path} is empty")
    return text


StreamResultsOpt = Annotated[
    str | None,
    typer.Option(
        help="Put live token deltas and cancel flags here instead of the results store, "
        "e.g. --results s3://bucket/results --stream-results redis://host:6379/0"
    ),
]


@dataclass(frozen=True)
class WorkerRun:
    """What `qworker worker` takes besides the engine config and the worker settings."""

    queue: str | None
    results: str | None
    stream_results: str | None
    lease_timeout_s: float | None
    burst: bool
    log_level: str


@app.command()
@engine_options()
@worker_options()
def worker(
    queue: QueueOpt = None,
    results: ResultsOpt = None,
    stream_results: StreamResultsOpt = None,
    queue_url_file: QueueFileOpt = None,
    results_url_file: ResultsFileOpt = None,
    *,
    engine_config: EngineConfig,
    settings: WorkerSettings,
    lease_timeout_s: Annotated[
        float | None,
        typer.Option(help="Lease without extension (none: 30 s; SQS: the queue's VisibilityTimeout)"),
    ] = None,
    burst: Annotated[bool, typer.Option(help="Process what is queued, then exit")] = False,
    log_level: Annotated[str, typer.Option(help="Root log level")] = "INFO",
) -> None:
    """Serve jobs from a queue until SIGTERM (then drain and exit 0)."""
    queue = url_from(queue, queue_url_file, "--queue")
    results = url_from(results, results_url_file, "--results")
    with reported_errors():
        serve_worker(
            engine_config,
            settings,
            WorkerRun(queue, results, stream_results, lease_timeout_s, burst, log_level),
        )


def serve_worker(engine_config: EngineConfig, settings: WorkerSettings, run: WorkerRun) -> None:
    """Everything `qworker worker` does once its options are parsed: connect, load the model, serve."""
    logging.basicConfig(level=run.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from qworker.backends.connections import (
        default_results_url,
        open_sink,
        open_source,
        redact_url,
        resolve_url,
    )
    from qworker.health import HealthServer, HealthState
    from qworker.worker.loop import Worker
    from qworker.worker.metrics import WorkerMetrics
    from qworker.worker.settings import quiet_payload_loggers

    quiet_payload_loggers(settings.log_payloads)
    metrics, health = WorkerMetrics(), HealthState()
    # Up before torch is imported and the model loads: /readyz answers 503 meanwhile.
    server = None
    if settings.metrics_port is not None:
        server = HealthServer(metrics.registry, health, port=settings.metrics_port).start()
    from qworker.engine.startup import describe_hardware, load_engine_in_phases
    from qworker.startup import StartupTimings, process_age_s

    timings = StartupTimings()
    imported_at = process_age_s()  # the process start to here: Python, the CLI, torch, the engine
    if imported_at is not None:
        timings.record("import", imported_at)
    queue_url = resolve_url(run.queue)
    # Connect first: a wrong URL fails in a second, not after the model has loaded.
    with timings.phase("queue_connect"):
        with connecting("queue", queue_url):
            source = open_source(queue_url, consumer=settings.name, lease_timeout_s=run.lease_timeout_s)
        results_url = run.results or default_results_url(queue_url)
        with connecting("results", results_url):
            sink = open_sink(results_url, run.stream_results)
    # Results on the queue's own server are named without the queue's parameters (?stream=...).
    results_text = (
        redact_url(results_url)
        if run.results
        else f"on the queue's server {redact_url(queue_url.split('?')[0])}"
    )
    logging.getLogger("qworker.cli").info(
        "worker %s: queue %s, results %s%s",
        settings.name,
        redact_url(queue_url),
        results_text,
        f", stream results {redact_url(run.stream_results)}" if run.stream_results else "",
    )
    engine = load_engine_in_phases(engine_config, timings)
    hardware = describe_hardware(engine)
    metrics.set_info(
        model=engine_config.model,
        dtype=hardware.dtype,
        device=hardware.device,
        quantization=getattr(engine, "quantization", None),
    )
    w = Worker(engine, source, sink, settings, metrics=metrics, health=health)
    w.install_signal_handlers()
    timings.mark_ready()
    # Published with the worker's stats and metrics: the exporter and dashboards see each
    # worker's device and KV pool (mixed pools) and what its start cost.
    w.stats.hardware, w.stats.startup = hardware, timings
    metrics.set_hardware(hardware)
    metrics.set_startup(timings)
    logging.getLogger("qworker.cli").info(
        "worker %s on %s (%s, %.0f GiB), %d KV blocks of %d tokens, CUDA graphs %s; startup: %s",
        settings.name,
        hardware.device,
        hardware.device_name,
        hardware.device_memory_bytes / 2**30,
        hardware.num_kv_blocks,
        hardware.block_size,
        "on" if hardware.is_cuda_graphs_enabled else "off",
        timings.summary(),
    )
    # Tests and supervisors wait for this line before they send work or signals.
    print(f"qworker worker {settings.name} ready", flush=True)
    w.run(burst=run.burst)
    source.close()
    sink.close()
    if server is not None:
        server.close()


def _params_of(items: list[str]) -> dict[str, Any]:
    """--param NAME=VALUE items as params fields: VALUE read as JSON, else kept as a string."""
    params: dict[str, Any] = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or not name.strip():
            raise typer.BadParameter(f"{item!r} is not NAME=VALUE", param_hint="--param")
        try:
            params[name.strip()] = json.loads(text)
        except json.JSONDecodeError:
            params[name.strip()] = text
    return params


@app.command()
def submit(
    prompt: Annotated[str, typer.Argument(help="The prompt (sent as one user chat message unless --raw)")],
    queue: QueueOpt = None,
    results: ResultsOpt = None,
    stream_results: StreamResultsOpt = None,
    stream: Annotated[bool, typer.Option(help="Print tokens as they are generated")] = False,
    raw: Annotated[
        bool, typer.Option(help="Send the prompt as plain text, without the chat template")
    ] = False,
    max_tokens: Annotated[int, typer.Option(help="Most tokens to generate (params.max_tokens)")] = 128,
    temperature: Annotated[
        float, typer.Option(help="Sampling temperature; 0 is greedy (params.temperature)")
    ] = 0.0,
    param: Annotated[
        list[str] | None,
        typer.Option(
            "--param",
            help="Another SamplingParams field, NAME=VALUE with VALUE as JSON (else a string); repeatable, "
            "e.g. --param presence_penalty=0.5 --param 'logit_bias={\"77\": 100}'",
        ),
    ] = None,
    lora: Annotated[
        str | None, typer.Option(help="The LoRA adapter to generate with: a name the workers serve")
    ] = None,
    affinity: Annotated[
        str | None,
        typer.Option(help="The job's affinity key (none: derived from the prompt; docs/queues.md)"),
    ] = None,
    wait: Annotated[bool, typer.Option(help="Wait for the result and print it")] = True,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the result")] = 300.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print the whole result as JSON")] = False,
    log_level: Annotated[str, typer.Option(help="Root log level (DEBUG adds tracebacks)")] = "WARNING",
) -> None:
    """Submit one job; print its id, then (by default) its text. Exit codes: 0 completed, 1 the
    job ended otherwise (failed, timeout, cancelled), 2 an invalid job or URL, 3 a store out of
    reach, 6 no result within --timeout."""
    from qworker.jobs.client import Client

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    job: dict = {"params": {"max_tokens": max_tokens, "temperature": temperature, **_params_of(param or [])}}
    if raw:
        job["prompt"] = prompt
    else:
        job["messages"] = [{"role": "user", "content": prompt}]
    job.update({name: value for name, value in (("lora", lora), ("affinity", affinity)) if value is not None})
    with reported_errors(), connecting("queue", queue):
        client = Client(queue=queue, results=results, stream_results=stream_results)
    with reported_errors(), client:
        job_id = client.submit(job)
        typer.echo(f"job {job_id}", err=True)
        if not wait and not stream:
            return
        if stream:
            for text in client.stream(job_id, timeout=timeout):
                sys.stdout.write(text)
                sys.stdout.flush()
            sys.stdout.write("\n")
        result = client.result(job_id, timeout=timeout)
        if as_json:
            typer.echo(json.dumps(result.model_dump(mode="json"), indent=2))
        elif not stream:
            typer.echo(result.text)
        if result.status.value != "completed":
            typer.echo(
                f"status {result.status.value}: {result.error.message if result.error else ''}", err=True
            )
            raise typer.Exit(1)


@app.command()
def demo(
    num_jobs: Annotated[int, typer.Option(help="Chat jobs to submit")] = 20,
    model: Annotated[
        str, typer.Option(help="smollm2, a local Hugging Face directory, or a .gguf file")
    ] = "smollm2",
) -> None:
    """Embedded Redis + a worker on SmolLM2: submit chat jobs, stream one, print a table."""
    from qworker.demo import run_demo

    run_demo(num_jobs=num_jobs, model=model)


@app.command("metrics-exporter")
@config_options(PoolSizing, into="sizing", panel="Sizing")
def metrics_exporter(
    queue: Annotated[
        str | None, typer.Option(envvar=QUEUE_URL_ENV, help=f"The pool's queue URL, or ${QUEUE_URL_ENV}")
    ] = None,
    queue_url_file: QueueFileOpt = None,
    *,
    sizing: PoolSizing,
    stats_url: Annotated[
        str | None,
        typer.Option(
            envvar=STATS_URL_ENV,
            help="The workers' Redis result store, where their stats live, or "
            f"${STATS_URL_ENV} (none: the queue's Redis for a Redis Streams queue, else no reports)",
        ),
    ] = None,
    host: Annotated[str, typer.Option(help="Address to serve on")] = "0.0.0.0",
    port: Annotated[int, typer.Option(help="Port of /metrics, /healthz, /readyz")] = DEFAULT_EXPORTER_PORT,
    interval_s: Annotated[float, typer.Option(help="Seconds between readings")] = DEFAULT_INTERVAL_S,
    log_level: Annotated[str, typer.Option(help="Root log level")] = "INFO",
) -> None:
    """Serve a pool's KV demand (qworker_pool_demand_blocks, ..._desired_workers) for KEDA until
    SIGTERM. Reads the queue and the workers' stats; takes nothing from the queue."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from qworker.pool.exporter import run_metrics_exporter

    queue_url = url_from(queue, queue_url_file, "--queue")
    if queue_url is None:
        raise typer.BadParameter(f"give the pool's queue: --queue, ${QUEUE_URL_ENV} or --queue-url-file")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.set())
    run_metrics_exporter(
        queue_url,
        sizing,
        stats_url=stats_url,
        host=host,
        port=port,
        interval_s=interval_s,
        stop=stop,
    )


app.command("bench")(bench)
app.command("batch")(batch)

# -- gateway (qworker/gateway/command.py) --
from qworker.gateway.command import gateway  # noqa: E402 - its own block, beside its registration

app.command("gateway")(gateway)

# -- dashboard (qworker/gateway/dashboard/command.py; issue 42) --
from qworker.gateway.dashboard.command import dashboard  # noqa: E402 - beside its registration

app.command("dashboard")(dashboard)

dlq_app = typer.Typer(
    no_args_is_help=True,
    rich_markup_mode=None,
    help="Dead-letter queues: list, show, replay, purge (Redis Streams, SQS, Celery).",
)
app.add_typer(dlq_app, name="dlq")
DlqResultsOpt = Annotated[
    str | None,
    typer.Option(
        envvar=RESULTS_URL_ENV,
        help="Results URL, where replay removes a job's failed result (none: the queue server when "
        "it stores results)",
    ),
]


@contextmanager
def dead_letters(queue: str | None) -> Iterator[DeadLetterQueue]:
    from qworker.backends.connections import open_dead_letters

    with reported_errors(), connecting("queue", queue):
        dlq = open_dead_letters(queue)
    try:
        with reported_errors():
            yield dlq
    finally:
        dlq.close()


def _age_text(age_s: float | None) -> str:
    if age_s is None:
        return "-"
    if age_s < 120:
        return f"{age_s:.0f}s"
    return f"{age_s / 60:.0f}m" if age_s < 7200 else f"{age_s / 3600:.1f}h"


@dlq_app.command("list")
def dlq_list(
    queue: QueueOpt = None,
    limit: Annotated[int, typer.Option(help="Dead letters to read at most")] = 1000,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per line")] = False,
) -> None:
    """Dead letters, oldest first: id, job id, attempts, age, reason."""
    with dead_letters(queue) as dlq:
        letters = dlq.read(limit)
    if not letters:
        typer.echo("no dead letters", err=True)
    for letter in letters:
        if as_json:
            typer.echo(json.dumps({k: v for k, v in letter.as_dict().items() if k != "body"}))
        else:
            columns = [letter.id, letter.job_id or "-", str(letter.attempts), _age_text(letter.age_s())]
            typer.echo("\t".join([*columns, letter.reason.replace("\n", " ")]))


@dlq_app.command("show")
def dlq_show(
    dead_letter_id: Annotated[str, typer.Argument(metavar="ID", help="The id `list` shows")],
    queue: QueueOpt = None,
) -> None:
    """One dead letter with its body, as JSON."""
    with dead_letters(queue) as dlq:
        letter = dlq.show(dead_letter_id)
    if letter is None:
        typer.echo(f"no dead letter {dead_letter_id!r}", err=True)
        raise typer.Exit(1)
    typer.echo(json.dumps(letter.as_dict(), indent=2))


@dlq_app.command("replay")
def dlq_replay(
    dead_letter_ids: Annotated[
        list[str] | None,
        typer.Argument(metavar="ID", help="Ids that `list` shows (or --all)", show_default=False),
    ] = None,
    all_letters: Annotated[bool, typer.Option("--all", help="Replay every dead letter")] = False,
    queue: QueueOpt = None,
    results: DlqResultsOpt = None,
) -> None:
    """Put dead letters back on the queue as new messages (attempts start again) and remove the
    failed results that would make the worker skip them."""
    from qworker.backends.connections import default_results_url, open_sink, resolve_url

    if bool(dead_letter_ids) == all_letters:
        raise typer.BadParameter("give dead-letter ids or --all")
    with reported_errors(), connecting("results", results):
        sink = open_sink(results or default_results_url(resolve_url(queue)))
    try:
        with dead_letters(queue) as dlq:
            replayed = dlq.replay(None if all_letters else dead_letter_ids, sink)
    finally:
        sink.close()
    for letter in replayed:
        if letter.job_id is not None:
            typer.echo(f"replayed {letter.id} as job {letter.job_id}")
        else:
            typer.echo(
                f"replayed {letter.id}: its body is not a job, so the worker will dead-letter it again"
            )
    missing = set(dead_letter_ids or []) - {letter.id for letter in replayed}
    if missing:
        typer.echo(f"not found: {', '.join(sorted(missing))}", err=True)
        raise typer.Exit(1)


@dlq_app.command("purge")
def dlq_purge(
    queue: QueueOpt = None,
    yes: Annotated[bool, typer.Option("--yes", help="Do not ask for confirmation")] = False,
) -> None:
    """Remove every dead letter."""
    with dead_letters(queue) as dlq:
        if not yes:
            count = len(dlq.read())
            if count == 0:
                typer.echo("no dead letters to remove")
                return
            typer.confirm(f"remove {count} dead letters?", abort=True)
        removed = dlq.purge()
    typer.echo(f"removed {removed} dead letters")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
