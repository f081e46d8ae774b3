"""Stored results as one OpenAI response: each job's `chat.completion` or `text_completion` body
built by qworker batch's code (bodies.response_body), merged over the request's prompts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from qworker.gateway.errors import GatewayError
from qworker.gateway.mapping import PreparedRequest
from qworker.gateway.tokenizer import GatewayTokenizer
from qworker.jobs.job import JobResult, JobStatus
from qworker.openai.batches.pool import error_of_result, generation_from_result
from qworker.openai.bodies import Generation
from qworker.openai.bodies import response_body as row_response_body
from qworker.openai.format import ChatCompletion, RowError, TextCompletion, Usage
from qworker.openai.rows import Endpoint


def decoder(tokenizer: GatewayTokenizer | None) -> Callable[[int], str] | None:
    if tokenizer is None:
        return None
    return lambda token_id: tokenizer.decode([token_id])


def error_of(result: JobResult) -> GatewayError:
    """A job that did not complete, as the error its request gets. A job that ran out of time
    (its own deadline, or its wait in the queue past the request timeout) is a 504."""
    error: RowError = error_of_result(result)
    if error.status_code == 408:
        return GatewayError(504, error.message, code=error.code)
    return GatewayError.from_row_error(error)


def job_body(
    prepared: PreparedRequest, index: int, result: JobResult, tokenizer: GatewayTokenizer | None
) -> tuple[ChatCompletion | TextCompletion, Generation]:
    if result.status is not JobStatus.COMPLETED:
        raise error_of(result)
    generation = generation_from_result(result)
    row = prepared.rows[index]
    is_missing_logprobs = row.num_top_logprobs is not None and any(
        c.logprobs is None for c in generation.completions
    )
    if is_missing_logprobs or (row.num_prompt_logprobs is not None and generation.prompt_logprobs is None):
        # The worker's engine returned none (an engine without logprobs, e.g. the FakeEngine):
        # the upstream answer is incomplete, which is a 502, not a crash here.
        raise GatewayError(
            502, "the worker returned no logprobs for a request that asked for them", code="incomplete_result"
        )
    try:
        body = row_response_body(prepared.rows[index], generation, prepared.created, decoder(tokenizer))
    except RowError as exc:
        raise GatewayError.from_row_error(exc) from None
    return body, generation


def response_body(
    prepared: PreparedRequest, results: dict[str, JobResult], tokenizer: GatewayTokenizer | None
) -> dict[str, Any]:
    choices: list[dict[str, Any]] = []
    usages: list[Usage] = []
    for index, job in enumerate(prepared.jobs):
        body, _ = job_body(prepared, index, results[job.id], tokenizer)
        for choice in body.choices:
            data = choice.model_dump()
            data["index"] = index * prepared.n + choice.index
            echo_text = prepared.echo_texts[index]
            if echo_text is not None:
                data["text"] = echo_text + data["text"]
            choices.append(data)
        usages.append(body.usage)
    choices.sort(key=lambda c: c["index"])
    is_chat = prepared.endpoint is Endpoint.CHAT
    return {
        "id": f"{'chatcmpl' if is_chat else 'cmpl'}-{prepared.request_id}",
        "object": "chat.completion" if is_chat else "text_completion",
        "created": prepared.created,
        "model": prepared.rows[0].model,
        "choices": choices,
        "usage": Usage.total(usages).model_dump(),
        "system_fingerprint": None,
    }
