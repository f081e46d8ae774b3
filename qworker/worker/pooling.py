"""Pooling jobs in the worker: one job's inputs fan out into engine requests (`{job_id}:{i}`;
`#i` is taken by n > 1 children) and fan back in to one result, in input order.

The engine sees one prefill-only request per input (docs/pooling.md); what comes back is a
`PoolingRequestOutput` each, whose vector this module turns into the result's floats or base64.
Tensors stay in the engine's output object: the worker only asks it for a list of floats.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from qworker.engine.outputs import PoolingRequestOutput, StepOutput
from qworker.engine.pooling_params import PoolingParams
from qworker.errors import InvalidRequestError, UnsupportedTaskError
from qworker.jobs.pooling_job import PoolingJob, encode_vector
from qworker.jobs.result import JobError, PooledOutput
from qworker.worker.engine_protocol import EngineProtocol

# Between a job id and its input's index in a request id.
REQUEST_ID_SEPARATOR = ":"


def request_id_of(job_id: str, index: int) -> str:
    return f"{job_id}{REQUEST_ID_SEPARATOR}{index}"


def pooling_params(job: PoolingJob) -> PoolingParams:
    """The engine's parameters of every request of `job` (the engine checks their values)."""
    return PoolingParams(
        task=job.task,
        normalize=job.normalize,
        dimensions=job.dimensions,
        truncate_prompt_tokens=job.truncate_prompt_tokens,
        use_activation=job.use_activation,
    )


def check_task(engine: EngineProtocol, task: str) -> None:
    """UnsupportedTaskError, before any tokenizing, when the worker's model cannot do `task`."""
    supported = engine.supported_tasks
    if task not in supported:
        raise UnsupportedTaskError(
            f"the model {engine.config.model!r} cannot {task}: it supports "
            f"{', '.join(supported) or 'nothing'} (--runner and --convert in docs/pooling.md)"
        )


def pooling_prompts(engine: EngineProtocol, job: PoolingJob) -> list[dict[str, Any]]:
    """One engine prompt per input ({"prompt_token_ids", "prompt"?}), in input order. Raises
    InvalidRequestError (no tokenizer for text, UnsupportedTaskError)."""
    check_task(engine, job.task)
    if job.task == "score":
        assert job.query is not None and job.documents is not None, "PoolingJob checks score's fields"
        if engine.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer: a score job needs one")
        return [{"prompt_token_ids": engine.score_prompt(job.query, doc)} for doc in job.documents]
    prompts: list[dict[str, Any]] = []
    for item in job.inputs():
        if isinstance(item, list):
            prompts.append({"prompt_token_ids": list(item)})
            continue
        if engine.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer: send input as token ids")
        text, token_ids = engine.tokenize(item)
        prompts.append({"prompt": text, "prompt_token_ids": token_ids})
    return prompts


def num_tokens_to_compute(prompt: dict[str, Any], truncate_prompt_tokens: int | None) -> int:
    """The tokens the engine will prefill for one prompt (truncation keeps the last ones; -1,
    to the context, is counted as the whole prompt: a bound, for admission)."""
    num_tokens = len(prompt["prompt_token_ids"])
    if truncate_prompt_tokens is None or truncate_prompt_tokens < 1:
        return num_tokens
    return min(num_tokens, truncate_prompt_tokens)


@dataclass
class PoolingFanIn:
    """The engine requests of one pooling job and the outputs collected so far."""

    request_ids: list[str]
    # Per input: the tokens it prefills (admission's size of what is still to run).
    num_tokens: list[int]
    encoding_format: str
    outputs: dict[int, PooledOutput] = field(default_factory=dict)
    num_cached_tokens: int = 0
    error: JobError | None = None
    first_scheduled_at: float | None = None

    def __post_init__(self) -> None:
        self._index_of = {request_id: i for i, request_id in enumerate(self.request_ids)}

    @property
    def pending_request_ids(self) -> list[str]:
        return [r for i, r in enumerate(self.request_ids) if i not in self.outputs]

    @property
    def num_pending_tokens(self) -> int:
        return sum(n for i, n in enumerate(self.num_tokens) if i not in self.outputs)

    @property
    def is_done(self) -> bool:
        return self.error is not None or len(self.outputs) == len(self.request_ids)

    def collect(self, output: PoolingRequestOutput) -> None:
        """One input's finished output. An error the engine gave that input alone fails the job."""
        index = self._index_of[output.request_id]
        if output.error is not None:
            self.error = JobError(type=output.error.type, message=f"input {index}: {output.error.message}")
            return
        values = [float(v) for v in output.outputs.data.tolist()]
        self.outputs[index] = PooledOutput(
            index=index,
            data=encode_vector(values, "base64" if self.encoding_format == "base64" else "float"),
            num_prompt_tokens=len(output.prompt_token_ids),
        )
        self.num_cached_tokens += output.num_cached_tokens

    def pooled(self) -> list[PooledOutput]:
        return [self.outputs[i] for i in sorted(self.outputs)]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(o.num_prompt_tokens for o in self.outputs.values())


def collect_pooled(fan_in: PoolingFanIn, out: StepOutput) -> bool:
    """A finished step output of one of the fan-in's requests: collected. True when the job is
    done (every input in, or one failed)."""
    assert isinstance(out.output, PoolingRequestOutput), (
        "a pooling request finishes with a PoolingRequestOutput"
    )
    fan_in.collect(out.output)
    return fan_in.is_done
