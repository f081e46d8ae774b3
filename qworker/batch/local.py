"""Local mode: the rows run on an engine in this process.

Rows are read from the input stream as requests finish: at most `max_in_flight` are in the
engine (running or waiting there), twice max_num_seqs by default as in vLLM's run-batch, so
that the scheduler always has the next rows at hand and memory stays bounded by the engine's
capacity, not by the file. The engine runs on the calling (main) thread: torch's CPU matmuls are
slower when another thread drives them.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from qworker.errors import InvalidRequestError, PromptTooLongError
from qworker.jobs.job import JobStatus
from qworker.jobs.result import JobResult, PromptTokensDetails, Usage
from qworker.lora.adapter_list import AdapterList
from qworker.openai.batches.output import BatchOutput
from qworker.openai.batches.progress import Progress
from qworker.openai.bodies import Generation, response_body
from qworker.openai.format import RowError, error_line, success_line
from qworker.openai.pooling_rows import BatchRow, EmbeddingRow, embedding_line
from qworker.openai.rows import RowFailure, RowRequest
from qworker.worker.pooling import (
    PoolingFanIn,
    collect_pooled,
    num_tokens_to_compute,
    pooling_params,
    pooling_prompts,
    request_id_of,
)

if TYPE_CHECKING:
    from qworker.engine.llm_engine import LLMEngine


class LocalRunner:
    """Feeds rows to `engine` and writes each one's line to `output` when it finishes."""

    def __init__(
        self,
        engine: LLMEngine,
        output: BatchOutput,
        progress: Progress,
        max_in_flight: int | None = None,
        adapters: AdapterList | None = None,
    ) -> None:
        self.engine = engine
        # The LoRA adapters rows may name as their model (docs/lora.md).
        self.adapters = adapters or AdapterList()
        self.output = output
        self.progress = progress
        self.max_in_flight = max_in_flight or 2 * engine.config.max_num_seqs
        assert self.max_in_flight >= 1, f"max_in_flight must be >= 1, got {self.max_in_flight}"
        self._in_flight: dict[str, RowRequest] = {}
        # Embeddings rows: one engine request per input (worker/pooling.py), by the row's id.
        self._embeddings: dict[str, tuple[EmbeddingRow, PoolingFanIn]] = {}
        self._row_of_request: dict[str, str] = {}
        # The most rows held at once, for tests of the memory bound.
        self.max_rows_held = 0

    def run(self, rows: Iterable[BatchRow | RowFailure]) -> None:
        self.progress.start()
        pending = iter(rows)
        is_exhausted = False
        while True:
            while not is_exhausted and len(self._in_flight) + len(self._embeddings) < self.max_in_flight:
                item = next(pending, None)
                if item is None:
                    is_exhausted = True
                elif isinstance(item, RowFailure):
                    self._fail(item.custom_id, item.request_id, item.error)
                elif isinstance(item, EmbeddingRow):
                    self._add_embedding(item)
                else:
                    self._add(item)
            self.max_rows_held = max(self.max_rows_held, len(self._in_flight) + len(self._embeddings))
            if not self._in_flight and not self._embeddings:
                return
            for step_output in self.engine.step():
                row_id = self._row_of_request.pop(step_output.request_id, None)
                if row_id is not None:
                    self._collect_embedding(row_id, step_output)
                elif step_output.finished:
                    assert step_output.output is not None, "a finished step output carries the whole result"
                    self._finish(self._in_flight.pop(step_output.request_id), step_output.output)
            self.progress.tick()

    def _decode(self, token_id: int) -> str:
        return str(self.engine.tokenizer.decode([token_id]))

    def _prompt(self, row: RowRequest) -> dict[str, Any]:
        if isinstance(row.prompt, list):
            return {"prompt_token_ids": list(row.prompt)}
        if self.engine.tokenizer is None:
            raise RowError("this model has no tokenizer: give the prompt as a list of token ids")
        if row.messages is not None:
            return {
                "prompt_token_ids": self.engine.apply_chat_template(
                    row.messages, tools=row.tools, chat_template_kwargs=row.chat_template_kwargs
                )
            }
        assert row.prompt is not None, "a completions row has a prompt"
        text, token_ids = self.engine.tokenize(row.prompt)
        return {"prompt": text, "prompt_token_ids": token_ids}

    def _add(self, row: RowRequest) -> None:
        try:
            prompt = self._prompt(row)
            # No limit given (chat): up to the end of the context, as vLLM does.
            max_tokens = row.max_tokens or max(1, self.engine.max_model_len - len(prompt["prompt_token_ids"]))
            lora_request = self.adapters.resolve(row.lora) if row.lora is not None else None
            self.engine.add_request(
                row.request_id, prompt, row.sampling_params(max_tokens), lora_request=lora_request
            )
        except RowError as exc:
            self._fail(row.custom_id, row.request_id, exc)
        except PromptTooLongError as exc:
            self._fail(row.custom_id, row.request_id, RowError(str(exc), code="context_length_exceeded"))
        except InvalidRequestError as exc:
            self._fail(row.custom_id, row.request_id, RowError(str(exc)))
        except Exception as exc:  # a chat template that rejects this conversation, say
            self._fail(row.custom_id, row.request_id, RowError(f"cannot prepare the prompt: {exc}"))
        else:
            self._in_flight[row.request_id] = row

    def _add_embedding(self, row: EmbeddingRow) -> None:
        """One engine request per input; a refused input fails the row (its others aborted)."""
        request_ids: list[str] = []
        try:
            prompts = pooling_prompts(self.engine, row.job)
            params = pooling_params(row.job)
            for index, prompt in enumerate(prompts):
                request_ids.append(request_id_of(row.request_id, index))
                self.engine.add_request(request_ids[-1], prompt, params)
        except Exception as exc:
            for request_id in request_ids[:-1]:
                self.engine.abort(request_id)
            self._fail(row.custom_id, row.request_id, _row_error(exc))
            return
        num_tokens = [num_tokens_to_compute(p, row.job.truncate_prompt_tokens) for p in prompts]
        self._embeddings[row.request_id] = (
            row,
            PoolingFanIn(request_ids, num_tokens, row.job.encoding_format),
        )
        self._row_of_request.update(dict.fromkeys(request_ids, row.request_id))

    def _collect_embedding(self, row_id: str, step_output: Any) -> None:
        if not step_output.finished:
            self._row_of_request[step_output.request_id] = row_id  # a chunk before its last
            return
        row, fan_in = self._embeddings[row_id]
        if not collect_pooled(fan_in, step_output):
            return
        del self._embeddings[row_id]
        for request_id in fan_in.pending_request_ids:  # the engine failed one: the rest stop
            self._row_of_request.pop(request_id, None)
            self.engine.abort(request_id)
        if fan_in.error is not None:
            self._fail(
                row.custom_id, row.request_id, RowError(f"{fan_in.error.type}: {fan_in.error.message}")
            )
            return
        result = JobResult(
            id=row.request_id,
            status=JobStatus.COMPLETED,
            pooled=fan_in.pooled(),
            usage=Usage(
                prompt_tokens=fan_in.num_prompt_tokens,
                prompt_tokens_details=PromptTokensDetails(cached_tokens=fan_in.num_cached_tokens),
            ),
        )
        line, num_prompt_tokens = embedding_line(row, result, int(time.time()))
        self.output.write(line)
        self.progress.row_done(200, num_prompt_tokens, 0)

    def _finish(self, row: RowRequest, output: Any) -> None:
        error = getattr(output, "error", None)
        if error is not None:  # the engine failed it alone (a grammar that did not compile)
            self._fail(row.custom_id, row.request_id, RowError(f"{error.type}: {error.message}"))
            return
        generation = Generation.from_request_output(
            output, with_prompt_logprobs=row.num_prompt_logprobs is not None
        )
        try:
            body = response_body(row, generation, int(time.time()), self._decode)
        except RowError as exc:
            self._fail(row.custom_id, row.request_id, exc)
            return
        self.output.write(success_line(row.custom_id, row.request_id, body))
        self.progress.row_done(200, body.usage.prompt_tokens, body.usage.completion_tokens)

    def _fail(self, custom_id: str, request_id: str, error: RowError) -> None:
        self.output.write(error_line(custom_id, request_id, error))
        self.progress.row_done(error.status_code)


def _row_error(exc: Exception) -> RowError:
    """An engine's refusal of a row's input as its error line's error."""
    if isinstance(exc, RowError):
        return exc
    if isinstance(exc, PromptTooLongError):
        return RowError(str(exc), code="context_length_exceeded")
    if isinstance(exc, InvalidRequestError):  # UnsupportedTaskError included
        return RowError(str(exc))
    return RowError(f"cannot prepare the input: {exc}")
