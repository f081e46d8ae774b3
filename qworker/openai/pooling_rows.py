"""Batch rows with `url: "/v1/embeddings"`: parsed into embed jobs, beside the generation rows
that rows.py parses, and their output lines in OpenAI's shape (an embeddings list as the body).

`prepare_batch_rows` is what `qworker batch` and the Batches API read a file through: each row
is an EmbeddingRow, a generation RowRequest (rows.parse_row), or the RowFailure its error line
reports.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass

from qworker.jobs.pooling_job import PoolingJob
from qworker.jobs.result import JobResult
from qworker.openai.batches.files import InputRow
from qworker.openai.format import SUPPORTED_URLS, BatchOutputLine, RowError, success_line
from qworker.openai.pooling_bodies import embedding_response
from qworker.openai.pooling_format import EmbeddingResponse
from qworker.openai.pooling_requests import EMBEDDINGS_URL, embedding_job
from qworker.openai.rows import RowFailure, RowRequest, prepare_rows, request_id_for

# The urls a batch row may name.
BATCH_URLS = (*SUPPORTED_URLS, EMBEDDINGS_URL)


@dataclass(frozen=True)
class EmbeddingRow:
    """An embeddings row: its embed job (whose id is the row's request id) and the model it named."""

    custom_id: str
    request_id: str
    model: str
    job: PoolingJob


BatchRow = RowRequest | EmbeddingRow


def parse_embedding_row(
    custom_id: str, body: object, *, batch_id: str, served_model_names: Collection[str]
) -> EmbeddingRow:
    """RowError for a body that cannot run (the field named), as parse_row's."""
    if not isinstance(body, dict):
        raise RowError("body must be a JSON object", param="body")
    names = list(served_model_names)
    model = body.get("model", names[0])
    if model not in names:
        raise RowError(
            f"the model {model!r} does not exist here; this batch serves {', '.join(map(repr, names))}",
            status_code=404,
            code="model_not_found",
            param="model",
        )
    request_id = request_id_for(batch_id, custom_id)
    job = embedding_job(body, job_id=request_id)
    return EmbeddingRow(
        custom_id, request_id, str(model), job.model_copy(update={"metadata": {"custom_id": custom_id}})
    )


def prepare_batch_rows(
    rows: Iterable[InputRow],
    *,
    batch_id: str,
    served_model_names: Collection[str],
    adapter_names: Collection[str] = (),
) -> Iterator[BatchRow | RowFailure]:
    """Each input row as a request (embeddings or generation), or the failure its line reports."""
    for row in rows:
        if row.url == EMBEDDINGS_URL:
            try:
                yield parse_embedding_row(
                    row.custom_id, row.body, batch_id=batch_id, served_model_names=served_model_names
                )
            except RowError as exc:
                yield RowFailure(row.custom_id, request_id_for(batch_id, row.custom_id), exc)
        elif row.url not in BATCH_URLS:
            error = RowError(
                f"url {row.url!r} is not supported; use {', '.join(BATCH_URLS)}",
                code="invalid_url",
                param="url",
            )
            yield RowFailure(row.custom_id, request_id_for(batch_id, row.custom_id), error)
        else:
            yield from prepare_rows(
                [row], batch_id=batch_id, served_model_names=served_model_names, adapter_names=adapter_names
            )


def embedding_line(row: EmbeddingRow, result: JobResult, created: int) -> tuple[BatchOutputLine, int]:
    """A completed embed job's output line, and its prompt tokens."""
    body: EmbeddingResponse = embedding_response(row.request_id, created, row.model, result)
    return success_line(row.custom_id, row.request_id, body), body.usage.prompt_tokens
