"""`qworker gateway`: serve the OpenAI-compatible HTTP front of a pool with uvicorn.

    qworker gateway --queue-url-file /run/secrets/queue --api-key-file /run/secrets/keys --port 8000

Options come from GatewaySettings (qworker/cli_options.py); URLs and keys never from argv values
that a process list shows, unless given as plain --queue (a URL without a password).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer

from qworker import envs
from qworker.backends import Requirement
from qworker.cli_options import config_options
from qworker.errors import MissingDependencyError
from qworker.gateway.settings import GatewaySettings

QUEUE_URL_ENV = envs.QWORKER_QUEUE_URL.name
RESULTS_URL_ENV = envs.QWORKER_RESULTS_URL.name
STREAM_RESULTS_URL_ENV = envs.QWORKER_STREAM_RESULTS_URL.name


def _read_secret_file(path: Path | None, option: str) -> str | None:
    if path is None:
        return None
    try:
        text = path.read_text().strip()
    except OSError as exc:
        raise typer.BadParameter(f"cannot read {option} {path}: {exc}") from None
    if not text:
        raise typer.BadParameter(f"{option} {path} is empty")
    return text


def _one_of(value: str | None, path: Path | None, option: str) -> str | None:
    from_file = _read_secret_file(path, f"{option}-url-file")
    if from_file is not None and value is not None:
        raise typer.BadParameter(
            f"give {option} (or its environment variable) or {option}-url-file, not both"
        )
    return from_file if from_file is not None else value


# What `qworker gateway` imports beyond the base install (the `gateway` extra).
GATEWAY_LIBRARIES = ("fastapi", "uvicorn", "httpx", "tokenizers", "jinja2")


def require_gateway_libraries() -> None:
    """A MissingDependencyError naming the extra when the gateway's libraries are not installed."""
    missing = [name for name in GATEWAY_LIBRARIES if not Requirement(name, "gateway").is_installed()]
    if missing:
        raise MissingDependencyError(
            f"the gateway needs {', '.join(missing)}: pip install 'qworker[gateway]'"
        )


@config_options(GatewaySettings, into="settings", panel="Gateway")
def gateway(
    queue: Annotated[
        str | None,
        typer.Option(
            envvar=QUEUE_URL_ENV, help=f"The pool's queue URL, or ${QUEUE_URL_ENV} (none: embedded Redis)"
        ),
    ] = None,
    results: Annotated[
        str | None,
        typer.Option(
            envvar=RESULTS_URL_ENV, help=f"Results URL, or ${RESULTS_URL_ENV} (none: the queue server)"
        ),
    ] = None,
    stream_results: Annotated[
        str | None,
        typer.Option(
            envvar=STREAM_RESULTS_URL_ENV,
            help="Live token deltas and cancel flags, when results are elsewhere (S3): a redis:// URL "
            f"or ${STREAM_RESULTS_URL_ENV}; without a delta store, a stream sends the whole text "
            "when the job ends",
        ),
    ] = None,
    queue_url_file: Annotated[Path | None, typer.Option(help="Read the queue URL from this file")] = None,
    results_url_file: Annotated[Path | None, typer.Option(help="Read the results URL from this file")] = None,
    stream_results_url_file: Annotated[
        Path | None, typer.Option(help="Read the stream-results URL from this file")
    ] = None,
    api_key_file: Annotated[
        Path | None,
        typer.Option(
            help="Bearer API keys, one a line (also $QWORKER_API_KEYS, comma-separated); none: open"
        ),
    ] = None,
    *,
    settings: GatewaySettings,
    log_level: Annotated[str, typer.Option(help="Root log level")] = "INFO",
) -> None:
    """Serve OpenAI's /v1/chat/completions, /v1/completions, /v1/models, vLLM's /tokenize and
    /detokenize, /healthz, /readyz and /metrics in front of a pool. Needs no worker to start."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from qworker.cli_errors import connecting, reported_errors

    with reported_errors():
        require_gateway_libraries()
    import uvicorn

    from qworker.gateway.app import create_app
    from qworker.gateway.auth import ApiKeyError, load_api_keys
    from qworker.gateway.http_protocol import server_options

    queue = _one_of(queue, queue_url_file, "--queue")
    results = _one_of(results, results_url_file, "--results")
    stream_results = _one_of(stream_results, stream_results_url_file, "--stream-results")
    try:
        keys = load_api_keys(api_key_file)
    except ApiKeyError as exc:
        raise typer.BadParameter(str(exc)) from None

    # A Redis queue is connected to at once (the producer makes sure its group exists): a store
    # that does not answer is one error line and exit code 3, and the orchestrator restarts us.
    with reported_errors(), connecting("queue", queue):
        app = create_app(settings, queue=queue, results=results, stream_results=stream_results, api_keys=keys)
    logging.getLogger("qworker.gateway").info(
        "gateway on %s:%d for model %s, %s",
        settings.host,
        settings.port,
        settings.model,
        f"{len(keys)} API key(s)" if keys else "no API keys (open)",
    )
    uvicorn.run(
        app, host=settings.host, port=settings.port, log_level=log_level.lower(), **server_options(settings)
    )
