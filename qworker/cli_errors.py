"""How the `qworker` commands end on an error a user can fix: one line on stderr and a documented
exit code (docs/WORKER.md lists them), the traceback at DEBUG. Shared by every command, the
gateway's included, so it sits below them all."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import typer

from qworker.backends.errors import translate_error
from qworker.errors import ConnectError, EngineFailedError, InvalidRequestError, QworkerError
from qworker.worker.retry import BrokerOutageError

# Exit codes (docs/WORKER.md lists them). 0: done (burst) or drained (SIGTERM); 1: an unexpected
# error, with its traceback; 2: click's usage error, also a bad URL or model.
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3  # a queue or result store that cannot be reached or logged in to
EXIT_ENGINE_FAILED = 4  # engine steps failed max_step_failures times in a row
EXIT_BROKER_OUTAGE = 5  # the queue or results store was unreachable longer than --broker-outage-s
EXIT_WAIT_TIMEOUT = 6  # `submit`: no result (or no stream output) within --timeout


def connection_problem(exc: BaseException) -> str | None:
    """What went wrong, in a line, when `exc` is a store's failure as its backend reads it
    (qworker/backends/errors.py: unreachable, refused credentials, an error answer); None for
    anything else. The worker's retry reads the same translation."""
    translated = translate_error(exc)
    return None if translated is None else str(translated) or type(exc).__name__


@contextmanager
def connecting(role: str, url: str | None) -> Iterator[None]:
    """Opening the `role` store ("queue", "results") at `url`: a failure to reach it becomes a
    ConnectError that names it (redacted) and says what was tried."""
    from qworker.backends.connections import redact_url

    try:
        yield
    except Exception as exc:
        problem = connection_problem(exc)
        if problem is None:
            raise
        raise ConnectError(f"cannot connect to the {role} at {redact_url(url)}: {problem}") from exc


@contextmanager
def reported_errors() -> Iterator[None]:
    """Errors a user can fix (a bad URL or model, an unreachable store, a broken engine) end the
    command with one line on stderr and their exit code; the traceback is logged at DEBUG.
    Anything else propagates with its traceback (exit 1)."""
    from pydantic import ValidationError

    try:
        yield
    except Exception as exc:
        if isinstance(exc, ValidationError):
            from qworker.jobs.job import format_validation_error

            exc, code = InvalidRequestError(f"invalid job: {format_validation_error(exc)}"), EXIT_USAGE
        elif isinstance(exc, TimeoutError):
            code = EXIT_WAIT_TIMEOUT
        elif isinstance(exc, EngineFailedError):
            code = EXIT_ENGINE_FAILED
        elif isinstance(exc, BrokerOutageError):
            code = EXIT_BROKER_OUTAGE
        elif isinstance(exc, ConnectError):
            code = EXIT_UNREACHABLE
        elif isinstance(exc, QworkerError):
            code = EXIT_USAGE
        else:
            problem = connection_problem(exc)
            if problem is None:
                raise
            exc, code = ConnectError(f"lost the connection: {problem}"), EXIT_UNREACHABLE
        logging.getLogger("qworker.cli").debug("the error in full", exc_info=True)
        typer.echo(f"qworker: error: {exc}", err=True)
        raise typer.Exit(code) from None
