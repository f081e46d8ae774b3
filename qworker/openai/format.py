"""The OpenAI batch file format, as pydantic models: an input line, an output line, and the
`chat.completion`, `text_completion` and error bodies an output line carries.

Input, one request per line (what OpenAI's Batch API and `vllm run-batch` read):

    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32}}

Output, one line per request, in the order requests finish:

    {"id": "batch_req_...", "custom_id": "q1",
     "response": {"status_code": 200, "request_id": "...", "body": {"object": "chat.completion", ...}},
     "error": null}

A row that cannot run gets a 4xx `status_code`, OpenAI's error object as the body, and `error`
set to its code and message (vLLM's run-batch sets `error`, OpenAI's API the body; both are here).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictStr

from qworker.openai.pooling_format import EmbeddingResponse

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
SUPPORTED_URLS = (CHAT_URL, COMPLETIONS_URL)

# -inf cannot be written as JSON; OpenAI-compatible servers (vLLM) write this floor instead.
MIN_LOGPROB = -9999.0


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# -- the input line ------------------------------------------------------------------------------


class BatchInputLine(BaseModel):
    """The fields of an input line that the whole-file check enforces. `url` and `body` are checked
    per row (a bad one fails that row only), so any JSON value passes here."""

    model_config = ConfigDict(extra="allow")

    custom_id: StrictStr = Field(min_length=1)
    method: Literal["POST"]
    url: Any = None
    body: Any = None


# -- bodies ----------------------------------------------------------------------------------------


class PromptTokensDetails(_Strict):
    """OpenAI's `usage.prompt_tokens_details` (the SDK's `PromptTokensDetails`)."""

    # Prompt tokens whose KV came from a prefix cache when the request was first scheduled
    # (vLLM's num_cached_tokens): always written, 0 when nothing hit.
    cached_tokens: int = 0


class Usage(_Strict):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # A default, so that output lines written before the field read back.
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)

    @classmethod
    def total(cls, usages: Iterable[Usage]) -> Usage:
        """The sum of several (a completions body with several prompts: one job each)."""
        usages = list(usages)
        return cls(
            prompt_tokens=sum(u.prompt_tokens for u in usages),
            completion_tokens=sum(u.completion_tokens for u in usages),
            total_tokens=sum(u.total_tokens for u in usages),
            prompt_tokens_details=PromptTokensDetails(
                cached_tokens=sum(u.prompt_tokens_details.cached_tokens for u in usages)
            ),
        )


class TopLogprob(_Strict):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(_Strict):
    """One generated token of a chat choice: its logprob and the most likely tokens at its place."""

    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Strict):
    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None = None


class AssistantMessage(_Strict):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None
    # Tool calls (openai/tool_parsers.py): [{id, type: function, function: {name, arguments}}].
    # Left out of the JSON when there is none, as OpenAI does.
    tool_calls: list[dict[str, Any]] | None = Field(default=None, exclude_if=lambda v: v is None)
    # With a reasoning parser (openai/reasoning.py): the text of the <think> block, under vLLM's
    # name and its newer one (the same text); left out when there is none.
    reasoning_content: str | None = Field(default=None, exclude_if=lambda v: v is None)
    reasoning: str | None = Field(default=None, exclude_if=lambda v: v is None)


FinishReason = Literal["stop", "length", "tool_calls"]


class ChatChoice(_Strict):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason


class ChatCompletion(_Strict):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class CompletionLogprobs(_Strict):
    """The legacy completions shape: parallel lists, one entry per token."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class TextChoice(_Strict):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason


class TextCompletion(_Strict):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[TextChoice]
    usage: Usage
    system_fingerprint: str | None = None


class ErrorInfo(_Strict):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(_Strict):
    error: ErrorInfo


# -- the output line -------------------------------------------------------------------------------


class BatchResponse(_Strict):
    status_code: int
    request_id: str
    # An embeddings row's body is OpenAI's embeddings list (openai/pooling_format.py).
    body: ChatCompletion | TextCompletion | EmbeddingResponse | ErrorBody


class BatchError(_Strict):
    code: str
    message: str


class BatchOutputLine(_Strict):
    id: str
    custom_id: str
    response: BatchResponse | None
    error: BatchError | None

    @property
    def is_error(self) -> bool:
        return self.error is not None or self.response is None or self.response.status_code >= 400


class RowError(Exception):
    """A row that gets an error line instead of a completion: HTTP status, OpenAI error type and
    code, and a message that says what to fix."""

    def __init__(
        self,
        message: str,
        *,
        status_code: int = 400,
        code: str = "invalid_request_error",
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.code = code
        self.param = param

    @property
    def error_type(self) -> str:
        if self.status_code == 404:
            return "not_found_error"
        return "invalid_request_error" if self.status_code < 500 else "server_error"


def output_line_id(request_id: str) -> str:
    return f"batch_req_{request_id.replace('-', '')}"


def success_line(
    custom_id: str, request_id: str, body: ChatCompletion | TextCompletion | EmbeddingResponse
) -> BatchOutputLine:
    return BatchOutputLine(
        id=output_line_id(request_id),
        custom_id=custom_id,
        response=BatchResponse(status_code=200, request_id=request_id, body=body),
        error=None,
    )


def error_line(custom_id: str, request_id: str, error: RowError) -> BatchOutputLine:
    body = ErrorBody(
        error=ErrorInfo(message=error.message, type=error.error_type, param=error.param, code=error.code)
    )
    return BatchOutputLine(
        id=output_line_id(request_id),
        custom_id=custom_id,
        response=BatchResponse(status_code=error.status_code, request_id=request_id, body=body),
        error=BatchError(code=error.code, message=error.message),
    )
