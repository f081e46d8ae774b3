"""The `qworker` command (also `python -m qworker`): worker, submit, demo, and bench (qworker.bench)."""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass
from typing import Annotated

import typer

from qworker.bench.command import bench
from qworker.cli_options import engine_options, worker_options
from qworker.config import EngineConfig
from qworker.worker.settings import WorkerSettings

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

QueueOpt = Annotated[
    str | None,
    typer.Option(help="Queue URL, e.g. redis://127.0.0.1:6379/0?stream=jobs (none: embedded Redis)"),
]
ResultsOpt = Annotated[
    str | None,
    typer.Option(help="Results URL: redis://, s3://bucket/prefix, celery+redis:// (none: the queue server)"),
]
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
    serve_worker(
        engine_config, settings, WorkerRun(queue, results, stream_results, lease_timeout_s, burst, log_level)
    )


def serve_worker(engine_config: EngineConfig, settings: WorkerSettings, run: WorkerRun) -> None:
    """Everything `qworker worker` does once its options are parsed: connect, load the model, serve."""
    logging.basicConfig(level=run.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from qworker.engine.llm_engine import LLMEngine
    from qworker.worker.connections import (
        default_results_url,
        open_sink,
        open_source,
        redact_url,
        resolve_url,
    )
    from qworker.worker.loop import Worker
    from qworker.worker.settings import quiet_payload_loggers

    quiet_payload_loggers(settings.log_payloads)
    queue_url = resolve_url(run.queue)
    # Connect first: a wrong URL fails in a second, not after the model has loaded.
    source = open_source(queue_url, consumer=settings.name, lease_timeout_s=run.lease_timeout_s)
    results_url = run.results or default_results_url(queue_url)
    sink = open_sink(results_url, run.stream_results)
    logging.getLogger("qworker.cli").info(
        "worker %s: queue %s, results %s%s",
        settings.name,
        redact_url(queue_url),
        redact_url(results_url),
        f", stream results {redact_url(run.stream_results)}" if run.stream_results else "",
    )
    engine = LLMEngine(engine_config)
    w = Worker(engine, source, sink, settings)
    w.install_signal_handlers()
    # Tests and supervisors wait for this line before they send work or signals.
    print(f"qworker worker {settings.name} ready", flush=True)
    w.run(burst=run.burst)
    source.close()
    sink.close()


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
    max_tokens: int = 128,
    temperature: float = 0.0,
    wait: Annotated[bool, typer.Option(help="Wait for the result and print it")] = True,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the result")] = 300.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print the whole result as JSON")] = False,
) -> None:
    """Submit one job; print its id, then (by default) its text."""
    from qworker.worker.client import Client

    job: dict = {"params": {"max_tokens": max_tokens, "temperature": temperature}}
    if raw:
        job["prompt"] = prompt
    else:
        job["messages"] = [{"role": "user", "content": prompt}]
    with Client(queue=queue, results=results, stream_results=stream_results) as client:
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
    model: str = "smollm2",
) -> None:
    """Embedded Redis + a worker on SmolLM2: submit chat jobs, stream one, print a table."""
    from qworker.worker.demo import run_demo

    run_demo(num_jobs=num_jobs, model=model)


app.command("bench")(bench)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
