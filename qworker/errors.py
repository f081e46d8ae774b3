"""Typed errors. Bad user input raises one of these with a message that says what to fix."""

from __future__ import annotations


class QworkerError(Exception):
    """Base class for every error qworker raises on purpose."""


class InvalidRequestError(QworkerError, ValueError):
    """A request (prompt or sampling parameters) that can never be served as given."""


class UnknownAdapterError(InvalidRequestError):
    """A job or row names a LoRA adapter that is not served here (the message lists those that are)."""


class AdapterSettingsError(QworkerError, ValueError):
    """--lora-modules or --lora-dir cannot be read."""


class InvalidParamsError(InvalidRequestError):
    """A sampling parameter outside its allowed range."""


class UnsupportedTaskError(InvalidRequestError):
    """A request for a task (generate, embed, classify, score) that the engine's model cannot do
    as configured (its checkpoint, --runner, --convert). The message names the model, the task and
    the tasks it supports."""


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus at least one generated token) does not fit in the model's context."""


class ResumeRefusedError(InvalidRequestError):
    """Output tokens handed to the engine to continue a request from (an earlier attempt's) that
    it cannot continue: another model's or a corrupt checkpoint's tokens, past max_tokens or the
    context, a stop among them, text that does not match them, or a request kind that does not
    resume (n > 1, logprobs, structured outputs). The caller starts the request from zero."""


class LoRAAdapterError(InvalidRequestError):
    """A LoRA adapter that cannot be served: its files are missing or unreadable, it is not a
    LoRA adapter (another PEFT method, DoRA, a tensor that is no lora_A/lora_B), its rank is
    over max_lora_rank, it targets a module the model lacks (or one qworker does not adapt,
    such as MoE experts), its shapes differ from the base model's, or its weights hold NaN or
    inf. It fails only the requests that ask for that adapter (docs/lora.md)."""


class UnknownModelError(QworkerError, ValueError):
    """The model name or path does not resolve to a model qworker can load."""


class UnsupportedModelError(UnknownModelError):
    """A model whose `model_type` (or a part of it, such as its activation or RoPE type) no
    registered model family runs. The message lists the supported model types."""


class CheckpointError(QworkerError, ValueError):
    """A checkpoint whose tensors do not match its config: a tensor missing, one the model has
    no place for, or one of the wrong shape. Raised at load, before anything is served."""


class EngineStepError(QworkerError):
    """One engine step failed after it was scheduled. `request_ids` are the requests the step ran:
    their state is unknown, so the caller should abort them (which frees their KV blocks); the
    engine's other requests are untouched. The original exception is the `__cause__`."""

    def __init__(self, message: str, request_ids: list[str]) -> None:
        super().__init__(message)
        self.request_ids = request_ids


class EngineFailedError(QworkerError):
    """The engine failed `num_failures` steps in a row: it is broken, not one job. The worker has
    released the jobs it held to its peers and stops."""

    def __init__(self, message: str, num_failures: int) -> None:
        super().__init__(message)
        self.num_failures = num_failures


class StreamRestartedError(QworkerError):
    """A job's live stream restarted (a new attempt after its worker died or released it) and the
    new attempt's text differs from the text already yielded. Read the stream again from the
    start: it then begins with the latest attempt."""

    def __init__(self, job_id: str, attempt: int) -> None:
        super().__init__(
            f"job {job_id} restarted (attempt {attempt}) and its new text differs from what was "
            "already streamed; stream it again from the start"
        )
        self.job_id = job_id
        self.attempt = attempt


class ConnectError(QworkerError):
    """A queue or result store that cannot be reached, or that refuses the credentials given (or
    found none). The message names the store by its redacted URL and says what was tried."""


class ModelDownloadError(QworkerError):
    """A remote model that cannot be used as it is stored: an object whose size or checksum does
    not match what the store reports, a truncated checkpoint, no config.json under the prefix."""


class MissingDependencyError(QworkerError):
    """A feature was asked for whose library is not installed; the message names the extra."""


class BrokerError(QworkerError):
    """A queue's or result store's client library failed, as its backend reads the failure
    (qworker/backends/*/errors.py). The library's own exception is the `__cause__`. A plain
    BrokerError is an answer no retry changes and no setting explains (an unknown service error);
    the subclasses say which of the two it is."""


class TransientBrokerError(BrokerError, ConnectionError):
    """The store is away or overloaded for now: unreachable, a connection cut or timed out,
    throttled, a 5xx, a replica not yet promoted. The worker retries with backoff (worker/retry.py)
    until --broker-outage-s. A builtin ConnectionError too, so that code that catches those (the
    RabbitMQ backend raised them before this class existed) keeps catching these."""


class BrokerConfigurationError(BrokerError):
    """The store refuses what it was given, and will until an operator fixes it: wrong or missing
    credentials, no permission, a queue or bucket that does not exist or was declared otherwise."""


class InvalidConfigError(QworkerError, ValueError):
    """An engine option this machine or model cannot honour (a device that is not there, a
    context longer than the model's, more KV memory than the machine has): one line at start."""
