"""The engine's side of pooling requests (embed, classify, score): checked and made into scheduler
requests on the way in, and finished into a PoolingRequestOutput from the runner's pooled row.

They bypass the output processor: no tokens, no text, no detokenizer. The scheduler runs them as
prefill-only requests (chunked like any prefill, never decoded, their blocks freed after the last
chunk; a preempted one is recomputed from its first token).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qworker.engine.input_processor import InputProcessor, Prompt
from qworker.engine.outputs import PoolingOutput, PoolingRequestOutput, StepOutput
from qworker.engine.pooling_params import PoolingParams
from qworker.engine.request import Request
from qworker.engine.sampling_params import SamplingParams
from qworker.engine.tasks import ModelTasks
from qworker.errors import InvalidRequestError

# A Request's sampling_params is never read for a pooling request (it is never sampled); this
# one stands in so that the scheduler's and runner's rows keep one shape.
PREFILL_ONLY_SAMPLING = SamplingParams(max_tokens=1)


@dataclass
class _PoolingState:
    request: Request
    params: PoolingParams


class PoolingRequests:
    """The pooling requests in the engine, by id."""

    def __init__(
        self,
        tasks: ModelTasks,
        input_processor: InputProcessor,
        *,
        hidden_size: int,
        max_model_len: int,
        default_normalize: bool,
    ) -> None:
        self.tasks = tasks
        self.input_processor = input_processor
        self.hidden_size = hidden_size
        self.max_model_len = max_model_len
        self.default_normalize = default_normalize
        self._states: dict[str, _PoolingState] = {}

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._states

    def new_request(self, request_id: str, prompt: Prompt, params: PoolingParams, priority: int) -> Request:
        """Check a pooling request and make its scheduler request (UnsupportedTaskError for a task
        the model cannot do, InvalidParamsError or PromptTooLongError for bad input)."""
        if not isinstance(params, PoolingParams):
            raise InvalidRequestError(f"params must be PoolingParams, got {type(params).__name__}")
        self.tasks.check(params.task)
        params.check_model_limits(self.hidden_size)
        _, token_ids = self.input_processor.tokenize(prompt)
        token_ids = params.truncate(token_ids, self.max_model_len)
        self.input_processor.validate_prompt_token_ids(token_ids, prefill_only=True)
        request = Request(
            request_id,
            token_ids,
            PREFILL_ONLY_SAMPLING,
            priority=priority,
            pooling=self.tasks.spec_for(params.task, token_ids),
        )
        self._states[request_id] = _PoolingState(request, params)
        return request

    def drop(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def finish(self, request_id: str, pooled: torch.Tensor) -> StepOutput | None:
        """The finished output of a request whose last chunk ran (None: aborted meanwhile)."""
        state = self._states.pop(request_id, None)
        if state is None:
            return None
        request = state.request
        output = PoolingRequestOutput(
            request_id=request_id,
            prompt_token_ids=request.prompt_token_ids,
            outputs=PoolingOutput(state.params.finish(pooled, self.default_normalize)),
            finished=True,
            num_cached_tokens=max(request.num_cached_tokens, 0),
        )
        return StepOutput(request_id, [], "", True, "stop", output=output)
