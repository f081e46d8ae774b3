"""How the `qworker` commands end on an error a user can fix: one line on stderr and a documented
exit code (docs/WORKER.md lists them), the traceback at DEBUG. Shared by every command, the
gateway's included, so it sits below them all."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import typer

from qworker.errors import ConnectError, EngineFailedError, InvalidRequestError, QworkerError
from qworker.worker.retry import BrokerOutageError

# Exit codes (docs/WORKER.md lists them). 0: done (burst) or drained (SIGTERM); 1: an unexpected
# error, with its traceback; 2: click's usage error, also a bad URL or model.
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3  # a queue or result store that cannot be reached or logged in to
EXIT_ENGINE_FAILED = 4  # engine steps failed max_step_failures times in a row
EXIT_BROKER_OUTAGE = 5  # the queue or results store was unreachable longer than --broker-outage-s
EXIT_WAIT_TIMEOUT = 6  # `submit`: no result (or no stream output) within --timeout

AWS_CREDENTIAL_SOURCES = (
    "boto3 looked in the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY), the shared files "
    "(~/.aws/credentials, ~/.aws/config, AWS_PROFILE) and the container or instance role"
)


def connection_problem(exc: BaseException) -> str | None:
    """What went wrong, in a line, when `exc` is a client library's failure to reach or log in to
    a server (redis-py, botocore, kombu); None for anything else."""
    try:
        import redis

        if isinstance(exc, redis.AuthenticationError):
            return f"the server refused the credentials: {exc}"
        if isinstance(exc, (redis.ConnectionError, redis.TimeoutError)):
            return str(exc) or type(exc).__name__
    except ImportError:
        pass
    try:
        import botocore.exceptions as boto

        if isinstance(exc, (boto.NoCredentialsError, boto.PartialCredentialsError)):
            return f"no AWS credentials found: {AWS_CREDENTIAL_SOURCES}"
        if isinstance(exc, (boto.EndpointConnectionError, boto.ConnectTimeoutError, boto.ProfileNotFound)):
            return str(exc)
        if isinstance(exc, boto.ClientError):
            error = exc.response.get("Error", {})
            return f"the service answered {error.get('Code', '?')}: {error.get('Message', exc)}"
    except ImportError:
        pass
    try:
        from kombu.exceptions import OperationalError

        if isinstance(exc, OperationalError):
            return str(exc)
    except ImportError:
        pass
    return None


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
