"""The `qworker` command: worker, submit, demo (and bench, from qworker.bench)."""

from __future__ import annotations

import json
import logging
import sys
from typing import Annotated

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Queue-driven LLM inference worker.")

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


@app.command()
def worker(
    queue: QueueOpt = None,
    results: ResultsOpt = None,
    stream_results: StreamResultsOpt = None,
    model: Annotated[str, typer.Option(help="smollm2, a Hugging Face directory or a .gguf file")] = "smollm2",
    num_kv_blocks: Annotated[int | None, typer.Option(help="KV blocks (none: size from memory)")] = None,
    block_size: int = 16,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 2048,
    max_model_len: int | None = None,
    dtype: str = "auto",
    device: str = "auto",
    attention_backend: str = "auto",
    name: Annotated[str | None, typer.Option(help="Worker (consumer) name; unique per process")] = None,
    max_backlog: Annotated[int, typer.Option(help="Jobs held but not started (see docs/WORKER.md)")] = 8,
    reserve_blocks_per_seq: int = 1,
    max_attempts: int = 3,
    lease_timeout_s: Annotated[
        float | None, typer.Option(help="Lease without extension (default 30)")
    ] = None,
    drain_grace_s: Annotated[float, typer.Option(help="SIGTERM: finish what can within this")] = 30.0,
    burst: Annotated[bool, typer.Option(help="Process what is queued, then exit")] = False,
    log_level: str = "INFO",
    log_payloads: Annotated[
        bool | None,
        typer.Option(
            help="Log prompts and results at DEBUG (default: off, or QWORKER_LOG_PAYLOADS=1)",
        ),
    ] = None,
) -> None:
    """Serve jobs from a queue until SIGTERM (then drain and exit 0)."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from qworker.config import EngineConfig
    from qworker.engine.llm_engine import LLMEngine
    from qworker.worker.connections import (
        default_results_url,
        open_sink,
        open_source,
        redact_url,
        resolve_url,
    )
    from qworker.worker.loop import Worker
    from qworker.worker.settings import WorkerSettings, log_payloads_from_env, quiet_payload_loggers

    if log_payloads is None:
        log_payloads = log_payloads_from_env()
    quiet_payload_loggers(log_payloads)

    settings = WorkerSettings(
        max_backlog=max_backlog,
        reserve_blocks_per_seq=reserve_blocks_per_seq,
        max_attempts=max_attempts,
        drain_grace_s=drain_grace_s,
        log_payloads=log_payloads,
    )
    if name:
        settings.name = name
    queue_url = resolve_url(queue)
    # Connect first: a wrong URL fails in a second, not after the model has loaded.
    source = open_source(queue_url, consumer=settings.name, lease_timeout_s=lease_timeout_s)
    results_url = results or default_results_url(queue_url)
    sink = open_sink(results_url, stream_results)
    logging.getLogger("qworker.cli").info(
        "worker %s: queue %s, results %s%s",
        settings.name,
        redact_url(queue_url),
        redact_url(results_url),
        f", stream results {redact_url(stream_results)}" if stream_results else "",
    )
    engine = LLMEngine(
        EngineConfig(
            model=model,
            num_kv_blocks=num_kv_blocks,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            dtype=dtype,
            device=device,
            attention_backend=attention_backend,
        )
    )
    w = Worker(engine, source, sink, settings)
    w.install_signal_handlers()
    # Tests and supervisors wait for this line before they send work or signals.
    print(f"qworker worker {settings.name} ready", flush=True)
    w.run(burst=burst)
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


try:
    from qworker.bench.command import bench
except ImportError:  # the bench command lives in its own module, written separately
    pass
else:
    app.command("bench")(bench)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
