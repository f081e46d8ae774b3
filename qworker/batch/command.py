"""`qworker batch`: run an OpenAI batch file, locally or across a worker pool, resumably.

    qworker batch -i requests.jsonl -o results.jsonl [--model smollm2]          # in this process
    qworker batch -i s3://b/in.jsonl -o s3://b/out.jsonl --queue redis://...    # across the pool

The function is typer-compatible (qworker/cli.py registers it); run_batch is the same from Python.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from qworker.cli_options import engine_options
from qworker.config import EngineConfig
from qworker.lora.modules import parse_lora_modules
from qworker.openai.batches.output import BatchOutput, OutputFile, state_path
from qworker.openai.batches.progress import BatchSummary, Progress, ProgressMode
from qworker.openai.pooling_rows import BatchRow, prepare_batch_rows
from qworker.openai.rows import RowFailure

if TYPE_CHECKING:
    from qworker.engine.llm_engine import LLMEngine

logger = logging.getLogger("qworker.batch")

# Exit code of a bad input or output file (as for a usage error): nothing was run.
EXIT_BAD_FILE = 2


@dataclass
class BatchRun:
    """What `qworker batch` takes besides the engine config."""

    input: str
    output: str
    errors: str | None = None
    # None: local mode, in this process.
    queue: str | None = None
    results: str | None = None
    resume: bool = True
    # Names rows may give as body.model (none: the --model value).
    served_model_names: list[str] = field(default_factory=list)
    # LoRA adapters rows may name as body.model: name=path,... (local mode loads the paths; pool
    # mode needs the names only, the workers hold the adapters).
    lora_modules: str | None = None
    # None: from the input's content, so that the same file is the same batch.
    batch_id: str | None = None
    max_pending: int = 10_000
    # Staging copies of S3 outputs, and the pool journal for result stores without a record of
    # sent rows (none: qworker's cache folder).
    work_dir: Path | None = None
    progress: ProgressMode = ProgressMode.AUTO
    progress_interval_s: float = 10.0


def run_batch(run: BatchRun, engine_config: EngineConfig, engine: LLMEngine | None = None) -> BatchSummary:
    """Check the input, then run every row without a line in the output yet, and return the counts.
    Local mode loads the engine from `engine_config` unless given a loaded (say, warmed up) one.

    Raises BatchFileError (the input), OutputFileError (an output it cannot resume from) or
    BatchLocationError before anything is written or enqueued."""
    from qworker.openai.batches.files import cache_dir, iter_rows, parse_location
    from qworker.openai.batches.validate import check_input

    input_location = parse_location(run.input)
    output_location = parse_location(run.output)
    errors_location = parse_location(run.errors) if run.errors else None
    named = [str(input_location), str(output_location)] + ([str(errors_location)] if errors_location else [])
    if len(set(named)) != len(named):
        from qworker.openai.batches.files import BatchLocationError

        raise BatchLocationError(f"input, output and errors must be three different files: {named}")
    if run.queue is not None and run.results is None:
        from qworker.backends.connections import default_results_url

        # An sqs:// queue needs --results: say so before anything is written.
        default_results_url(run.queue)
    checked = check_input(input_location)
    batch_id = run.batch_id or checked.content_hash[:24]
    served = run.served_model_names or [engine_config.model]
    work_dir = run.work_dir or cache_dir() / "batch"
    output = BatchOutput(
        OutputFile(output_location, work_dir),
        OutputFile(errors_location, work_dir) if errors_location else None,
    )
    done = output.load(run.resume)
    num_done = len(done & checked.custom_ids)
    if len(done) > num_done:
        logger.warning(
            "%d lines of the output name custom_ids that are not in %s: another batch's output?",
            len(done) - num_done,
            input_location,
        )
    logger.info(
        "batch %s: %d rows, %d already in the output, %s",
        batch_id,
        checked.num_rows,
        num_done,
        f"across the pool at {_redacted(run.queue)}" if run.queue else "local",
    )
    summary = BatchSummary(checked.num_rows, num_done)
    rows = prepare_batch_rows(
        (row for row in iter_rows(input_location) if row.custom_id not in done),
        batch_id=batch_id,
        served_model_names=served,
        adapter_names=list(parse_lora_modules(run.lora_modules)),
    )
    journal_path = state_path(work_dir, output_location, f"{batch_id}.submitted")
    output.open()
    try:
        # Nothing left to run (a rerun of a finished batch): no model to load, no queue to open.
        if summary.num_to_run > 0 and run.queue is None:
            _run_local(engine or _load_engine(engine_config), run, output, summary, rows)
        elif summary.num_to_run > 0:
            _run_pool(engine_config, run, output, summary, rows, batch_id, journal_path)
    finally:
        output.close()
    journal_path.unlink(missing_ok=True)
    output.publish()
    return summary


def _load_engine(engine_config: EngineConfig) -> LLMEngine:
    from qworker.batch.invariance import local_engine_config
    from qworker.engine.llm_engine import LLMEngine

    return LLMEngine(local_engine_config(engine_config))


def _run_local(
    engine: LLMEngine,
    run: BatchRun,
    output: BatchOutput,
    summary: BatchSummary,
    rows: Iterator[BatchRow | RowFailure],
) -> None:
    from qworker.batch.local import LocalRunner
    from qworker.lora.adapter_list import AdapterList

    # Made after the model loaded: the progress and the throughput count the run alone.
    progress = Progress(summary, run.progress, run.progress_interval_s)
    try:
        LocalRunner(engine, output, progress, adapters=AdapterList(parse_lora_modules(run.lora_modules))).run(
            rows
        )
    finally:
        progress.close()


def _run_pool(
    engine_config: EngineConfig,
    run: BatchRun,
    output: BatchOutput,
    summary: BatchSummary,
    rows: Iterator[BatchRow | RowFailure],
    batch_id: str,
    journal_path: Path,
) -> None:
    from qworker.batch.invariance import warn_unless_pool_is_invariant
    from qworker.jobs.client import Client
    from qworker.openai.batches.pool import DEFAULT_POOL_MAX_TOKENS, PoolRunner
    from qworker.openai.batches.submitted import open_submitted
    from qworker.pool.batch_board import BatchBoard

    assert run.queue is not None, "pool mode needs a queue"
    with Client(queue=run.queue, results=run.results) as client:
        warn_unless_pool_is_invariant(client.sink)
        # The record of sent rows lives in the result store (a file only for stores without one).
        journal = open_submitted(client.sink, batch_id, journal_path)
        if not run.resume:
            journal.clear()
        progress = Progress(summary, run.progress, run.progress_interval_s)
        runner = PoolRunner(
            client,
            output,
            progress,
            journal,
            default_max_tokens=engine_config.max_model_len or DEFAULT_POOL_MAX_TOKENS,
            max_pending=run.max_pending,
        )
        # The dashboard's record of this batch, in the result store (qworker/pool/batch_board.py).
        board = BatchBoard.of_sink(client.sink, batch_id, source="cli")
        if board is not None:
            board.start_run(total=summary.num_input_rows, done_before=summary.num_already_done)
            output.listeners.append(board.observe_line)
        status = "failed"
        try:
            runner.run(rows)
            status = "completed"
        finally:
            progress.close()
            summary.num_enqueued = runner.num_enqueued
            if board is not None:
                board.set_status(status)


def _redacted(url: str) -> str:
    from qworker.backends.connections import redact_url

    return redact_url(url)


@engine_options()
def batch(
    input_file: Annotated[
        str, typer.Option("--input", "-i", help="OpenAI batch file (JSONL): a local path or s3://bucket/key")
    ],
    output_file: Annotated[
        str,
        typer.Option(
            "--output",
            "-o",
            help="Output JSONL, one line per row as rows finish: a local path or s3://bucket/key",
        ),
    ],
    errors: Annotated[
        str | None,
        typer.Option(
            help="Write failed rows' lines here instead of into the output (as OpenAI's error file)"
        ),
    ] = None,
    queue: Annotated[
        str | None,
        typer.Option(help="Run across the worker pool on this queue URL (none: in this process)"),
    ] = None,
    results: Annotated[
        str | None, typer.Option(help="Pool mode: the workers' results URL (none: the queue's server)")
    ] = None,
    resume: Annotated[
        bool,
        typer.Option(
            help="Skip rows that already have a line in the output (or errors) file and append; "
            "--no-resume starts the output over"
        ),
    ] = True,
    served_model_name: Annotated[
        list[str] | None,
        typer.Option(
            metavar="NAME", help="A name rows may give as body.model; repeatable (none: the --model value)"
        ),
    ] = None,
    lora_modules: Annotated[
        str | None,
        typer.Option(
            help="LoRA adapters rows may name as body.model, name=path,... (pool mode: names alone will "
            "do; local mode needs --enable-lora; docs/lora.md)"
        ),
    ] = None,
    batch_id: Annotated[
        str | None,
        typer.Option(help="Names the batch's jobs in pool mode (none: from a hash of the input's content)"),
    ] = None,
    max_pending: Annotated[
        int, typer.Option(help="Pool mode: most rows enqueued and not yet collected", min=1)
    ] = 10_000,
    work_dir: Annotated[
        Path | None,
        typer.Option(
            help="Staging of S3 outputs, and the pool's record of sent rows when the result store keeps "
            "none (none: ~/.cache/qworker/batch)"
        ),
    ] = None,
    progress: Annotated[
        ProgressMode, typer.Option(help="auto: a bar on a terminal, else a log line every interval")
    ] = ProgressMode.AUTO,
    progress_interval_s: Annotated[float, typer.Option(help="Seconds between progress log lines")] = 10.0,
    log_level: Annotated[str, typer.Option(help="Root log level")] = "INFO",
    *,
    engine_config: EngineConfig,
) -> None:
    """Run an OpenAI batch file (`/v1/chat/completions` and `/v1/completions` rows) and write one
    output line per row. A rerun of the same command resumes: rows already in the output are
    skipped. Exit code 2: the input is not a batch file (nothing was run)."""
    from qworker.backends.connections import InvalidURLError
    from qworker.openai.batches.files import BatchLocationError
    from qworker.openai.batches.output import OutputFileError
    from qworker.openai.batches.validate import BatchFileError

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run = BatchRun(
        input=input_file,
        output=output_file,
        errors=errors,
        queue=queue,
        results=results,
        resume=resume,
        served_model_names=list(served_model_name or []),
        lora_modules=lora_modules,
        batch_id=batch_id,
        max_pending=max_pending,
        work_dir=work_dir,
        progress=progress,
        progress_interval_s=progress_interval_s,
    )
    try:
        summary = run_batch(run, engine_config)
    except (BatchFileError, OutputFileError, BatchLocationError, InvalidURLError) as exc:
        typer.echo(f"qworker: error: {exc}", err=True)
        raise typer.Exit(EXIT_BAD_FILE) from None
    except KeyboardInterrupt:
        typer.echo(
            "interrupted: every finished row is in the output; rerun the same command to resume", err=True
        )
        raise typer.Exit(130) from None
    typer.echo(summary.to_text(), err=True)
