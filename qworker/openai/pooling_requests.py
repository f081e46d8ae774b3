"""Pooling request bodies as pooling jobs: OpenAI's embeddings, vLLM's `/v1/score`, `/v1/rerank`
(also in the Cohere and Jina shapes vLLM accepts) and `/pooling`. The gateway's routes and
`qworker batch`'s `/v1/embeddings` rows both build their jobs here, so that a body means the same
through every door. docs/pooling.md lists the fields.

- embeddings: `input` (a string, a list of strings, token ids, a list of token-id lists),
  `encoding_format` ("float" | "base64": little-endian float32, as OpenAI's), `dimensions`, `user`
  (accepted, unused), and vLLM's `truncate_prompt_tokens` and `normalize`.
- score: vLLM's `text_1` and `text_2`, each a string or a list: one text_1 against many text_2,
  or pairs in order (equal lengths). One job per distinct text_1 (a job scores one query).
- rerank: `query`, `documents` (strings, or Cohere's `{"text": ...}` objects), `top_n`,
  `return_documents`.
- pooling: embeddings' fields plus `task` ("embed" | "classify") and `use_activation`.

Each raises RowError naming the field (`param`) for a body that cannot run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from qworker.jobs.job import MAX_PRIORITY, MIN_PRIORITY
from qworker.jobs.pooling_job import MAX_POOLING_INPUTS, PoolingJob
from qworker.openai.format import RowError

EMBEDDINGS_URL = "/v1/embeddings"

_COMMON_FIELDS = frozenset({"model", "truncate_prompt_tokens", "priority", "affinity", "user"})
EMBEDDING_FIELDS = _COMMON_FIELDS | {"input", "encoding_format", "dimensions", "normalize"}
POOLING_FIELDS = EMBEDDING_FIELDS | {"task", "use_activation"}
SCORE_FIELDS = _COMMON_FIELDS | {"text_1", "text_2", "use_activation", "encoding_format"}
RERANK_FIELDS = _COMMON_FIELDS | {"query", "documents", "top_n", "return_documents", "use_activation"}
# Fields a rerank body of the Cohere API may carry that change nothing here.
RERANK_IGNORED_FIELDS = frozenset({"max_chunks_per_doc", "rank_fields"})
# The job fields the body's own fields fill, by name.
_JOB_FIELDS = ("truncate_prompt_tokens", "priority", "affinity")


def _check_fields(
    body: Any, allowed: frozenset[str], what: str, ignored: frozenset[str] = frozenset()
) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise RowError("the body must be a JSON object", param="body")
    unknown = sorted(set(body) - allowed - ignored)
    if unknown:
        raise RowError(
            f"{unknown[0]!r} is not a field of {what} requests (fields: {', '.join(sorted(allowed))})",
            code="unsupported_parameter",
            param=unknown[0],
        )
    priority = body.get("priority")
    if priority is not None and (
        not isinstance(priority, int)
        or isinstance(priority, bool)
        or not MIN_PRIORITY <= priority <= MAX_PRIORITY
    ):
        raise RowError(f"priority must be a 64-bit integer, got {priority!r}", param="priority")
    return body


def _job(fields: dict[str, Any], job_id: str | None) -> PoolingJob:
    """The job, or RowError naming the field its schema refused."""
    try:
        return PoolingJob.model_validate({**({"id": job_id} if job_id is not None else {}), **fields})
    except ValidationError as exc:
        item = exc.errors(include_url=False)[0]
        message = item["msg"].removeprefix("Value error, ")
        # A field's own check names it in loc; the job's cross-field checks begin with its name.
        named = str(item["loc"][0]) if item["loc"] else message.split(" ")[0].split("[")[0]
        param = named if named in PoolingJob.model_fields else None
        if item["loc"]:
            message = f"{'.'.join(str(x) for x in item['loc'])}: {message}"
        raise RowError(message, param=param) from None


def _given(body: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    return {name: body[name] for name in names if body.get(name) is not None}


def _check_input(value: Any) -> None:
    """Empty or too many inputs: said in OpenAI's words before the schema's."""
    if value is None:
        raise RowError("input is required", param="input")
    if value == "" or value == []:
        raise RowError("input is empty: give a string, token ids, or a list of either", param="input")
    # A flat list of ints is one input (token ids), however long: the context check sizes it.
    is_one_token_list = isinstance(value, list) and all(isinstance(v, int) for v in value)
    if isinstance(value, list) and not is_one_token_list and len(value) > MAX_POOLING_INPUTS:
        raise RowError(
            f"input holds {len(value)} items; the limit is {MAX_POOLING_INPUTS} per request", param="input"
        )


def embedding_job(body: Any, job_id: str | None = None) -> PoolingJob:
    """An OpenAI embeddings body (`/v1/embeddings`) as one embed job."""
    body = _check_fields(body, EMBEDDING_FIELDS, "embeddings")
    _check_input(body.get("input"))
    fields = _given(body, ("input", "encoding_format", "dimensions", "normalize", *_JOB_FIELDS))
    return _job({"task": "embed", **fields}, job_id)


def pooling_job(body: Any, job_id: str | None = None) -> PoolingJob:
    """vLLM's `/pooling` body: embeddings' fields and a `task` (embed, classify)."""
    body = _check_fields(body, POOLING_FIELDS, "pooling")
    task = body.get("task", "embed")
    if task not in ("embed", "classify"):
        raise RowError(f"task must be 'embed' or 'classify', got {task!r}", param="task")
    _check_input(body.get("input"))
    fields = _given(
        body, ("input", "encoding_format", "dimensions", "normalize", "use_activation", *_JOB_FIELDS)
    )
    return _job({"task": task, **fields}, job_id)


@dataclass(frozen=True)
class ScorePairs:
    """A score body's jobs: one per distinct first text, and where each pair's score lies in them."""

    jobs: list[PoolingJob]
    # Per pair, in the body's order: (the job's index, the document's index in that job).
    places: list[tuple[int, int]]


def _texts(body: dict[str, Any], name: str) -> list[str]:
    value = body.get(name)
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise RowError(f"{name} must be a string or a list of strings", param=name)
    if not value:
        raise RowError(f"{name} is empty", param=name)
    if any(not v for v in value):
        raise RowError(f"{name} holds an empty string", param=name)
    if len(value) > MAX_POOLING_INPUTS:
        raise RowError(f"{name} holds {len(value)} texts; the limit is {MAX_POOLING_INPUTS}", param=name)
    return value


def score_jobs(body: Any) -> ScorePairs:
    """vLLM's `/v1/score` body: `text_1` against `text_2` (1 x N, or N pairs in order)."""
    body = _check_fields(body, SCORE_FIELDS, "score")
    if body.get("encoding_format", "float") != "float":
        raise RowError("a score is a number: encoding_format must be 'float'", param="encoding_format")
    firsts, seconds = _texts(body, "text_1"), _texts(body, "text_2")
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        raise RowError(
            f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}: one text_1, or as many as text_2",
            param="text_2",
        )
    documents: dict[str, list[str]] = {}
    places = []
    for query, document in zip(firsts, seconds, strict=True):
        docs = documents.setdefault(query, [])
        places.append((list(documents).index(query), len(docs)))
        docs.append(document)
    extra = _given(body, ("use_activation", *_JOB_FIELDS))
    jobs = [_job({"task": "score", "query": q, "documents": d, **extra}, None) for q, d in documents.items()]
    return ScorePairs(jobs, places)


@dataclass(frozen=True)
class RerankRequest:
    job: PoolingJob
    documents: list[str]
    # How many results to return (the best first); None: all.
    top_n: int | None
    return_documents: bool


def rerank_job(body: Any) -> RerankRequest:
    """vLLM's rerank body (`/rerank`, `/v1/rerank`, `/v2/rerank`), Cohere's and Jina's shapes."""
    body = _check_fields(body, RERANK_FIELDS, "rerank", RERANK_IGNORED_FIELDS)
    query = body.get("query")
    if not isinstance(query, str):
        raise RowError("query must be a string", param="query")
    raw = body.get("documents")
    if not isinstance(raw, list):
        raise RowError('documents must be a list of strings or of {"text": ...} objects', param="documents")
    documents = []
    for index, item in enumerate(raw):
        text = item.get("text") if isinstance(item, dict) else item
        if not isinstance(text, str):
            raise RowError(
                f'documents[{index}] must be a string or a {{"text": ...}} object', param="documents"
            )
        documents.append(text)
    top_n = body.get("top_n")
    if top_n is not None and (not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 0):
        raise RowError(f"top_n must be a non-negative integer, got {top_n!r}", param="top_n")
    return_documents = body.get("return_documents", True)
    if not isinstance(return_documents, bool):
        raise RowError("return_documents must be true or false", param="return_documents")
    extra = _given(body, ("use_activation", *_JOB_FIELDS))
    job = _job({"task": "score", "query": query, "documents": documents, **extra}, None)
    # vLLM: top_n 0 (its default) returns every document.
    return RerankRequest(job, documents, top_n or None, return_documents)
