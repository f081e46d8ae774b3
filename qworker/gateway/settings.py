"""Gateway settings. Every field is also a `qworker gateway` option (qworker/cli_options.py): the
help text here is the option's help, the default here its default.

Secrets are not settings: API keys come from `--api-key-file` or `$QWORKER_API_KEYS` (auth.py),
queue and result URLs (which may carry passwords) from the environment or URL files, never argv.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# OpenAI's own request limit is far higher for files; for one completion body, 16 MiB holds any
# prompt that fits a context here, many times over.
DEFAULT_MAX_BODY_BYTES = 16 * 2**20


@dataclass(frozen=True)
class GatewaySettings:
    host: str = field(default="127.0.0.1", metadata={"help": "Address to serve on (0.0.0.0 in a container)"})
    port: int = field(
        default=8000, metadata={"help": "Port of the OpenAI routes, /healthz, /readyz, /metrics"}
    )
    model: str = field(
        default="smollm2",
        metadata={
            "help": "The model the pool serves: the name /v1/models lists and requests must use, and "
            "where the tokenizer is found when --tokenizer is not given (smollm2 or a local directory)"
        },
    )
    tokenizer: str | None = field(
        default=None,
        metadata={
            "help": "Directory with tokenizer.json (none: the model's directory, or the SmolLM2 cache "
            "a worker converted)"
        },
    )
    max_model_len: int | None = field(
        default=None,
        metadata={"help": "The workers' context in tokens (none: the model directory's config.json)"},
    )
    request_timeout_s: float = field(
        default=600.0,
        metadata={
            "help": "Longest wait for a result, queueing included (a worker may be starting from zero); "
            "past it: 504, and the job is cancelled"
        },
    )
    max_body_bytes: int = field(
        default=DEFAULT_MAX_BODY_BYTES, metadata={"help": "Request bodies over this get 413"}
    )
    max_waiting_blocks: int | None = field(
        default=None,
        metadata={
            "help": "Backpressure: refuse new work (429) while the KV blocks the queue's waiting jobs "
            "need exceed this (none: off)"
        },
    )
    lora_modules: str | None = field(
        default=None,
        metadata={
            "help": "LoRA adapters the workers serve, as the workers' name=path,... or names alone: "
            "each is a model name requests may use, listed in /v1/models with --model as its parent"
        },
    )
    block_size: int = field(default=16, metadata={"help": "Tokens per KV block: the workers' --block-size"})
    demand_interval_s: float = field(
        default=1.0, metadata={"help": "Seconds between readings of the queue's waiting demand"}
    )
    retry_after_s: int = field(default=2, metadata={"help": "Retry-After of a 429, in seconds"})
    max_inflight_requests: int = field(
        default=2048,
        metadata={"help": "Generation requests this replica serves at once; beyond: 429 (bounds its memory)"},
    )
    limit_concurrency: int = field(
        default=4096,
        metadata={
            "help": "Open connections served at once (idle ones included); one more gets 503 and "
            "is closed at once"
        },
    )
    timeout_keep_alive_s: int = field(
        default=5, metadata={"help": "Seconds an idle keep-alive connection stays open"}
    )
    header_timeout_s: float = field(
        default=10.0,
        metadata={
            "help": "Seconds a connection may take to send a request line and headers (a new "
            "connection, or a new request on a kept-alive one); past it: 408 and closed"
        },
    )
    default_max_tokens: int = field(
        default=4096,
        metadata={"help": "max_tokens of a chat request that gives none (capped by the context)"},
    )
    tool_call_parser: str | None = field(
        default=None,
        metadata={
            "help": 'What reads tool calls under tool_choice "auto": hermes, llama3_json or mistral '
            "(none: the one the model's chat template asks for; hermes for a template that renders "
            "no tools)"
        },
    )
    reasoning_parser: str | None = field(
        default=None,
        metadata={
            "help": "Split <think> reasoning off chat outputs into reasoning_content: qwen3 or "
            "deepseek_r1 (none: off)"
        },
    )

    # -- Files, Batches and async jobs (issue 23: file_store.py, batch_driver.py, webhooks.py) --
    files_url: str | None = field(
        default=None,
        metadata={
            "help": "Where /v1/files keeps file bytes: a local directory (one replica) or "
            "s3://bucket/prefix (several); none: ~/.cache/qworker/gateway-files"
        },
    )
    max_file_bytes: int = field(
        default=200 * 2**20, metadata={"help": "Uploads over this many bytes get 413 (OpenAI: 200 MB)"}
    )
    max_file_rows: int = field(
        default=50_000, metadata={"help": "Uploads over this many lines get 413 (OpenAI: 50,000 requests)"}
    )
    file_expiry_s: int = field(
        default=30 * 24 * 3600, metadata={"help": "Seconds an uploaded or output file is kept"}
    )
    batch_lease_s: float = field(
        default=15.0,
        metadata={"help": "Lease on a batch this replica drives; a killed replica's batch moves on after it"},
    )
    max_batch_attempts: int = field(
        default=5,
        metadata={
            "help": "Drivers a batch gets that fail or are killed before it ends failed, with the last "
            "error in its errors (a clean shutdown does not count)"
        },
    )
    batch_part_max_age_s: float = field(
        default=2.0,
        metadata={
            "help": "A batch's finished output lines reach the file store as a part at most this long "
            "after the first of them (or at 1000 lines or 4 MiB, whichever comes first)"
        },
    )
    max_driven_batches: int = field(
        default=4, metadata={"help": "Batches this replica drives at once (one thread each)"}
    )
    webhook_secret_file: str | None = field(
        default=None,
        metadata={
            "help": "File holding the Standard Webhooks secret (whsec_...); none: jobs take no webhook"
        },
    )
    webhook_allow: str = field(
        default="",
        metadata={
            "help": "Comma-separated hosts and networks (CIDR) webhooks may call; other hosts are allowed "
            "only on public addresses (private, loopback and link-local ranges are refused)"
        },
    )
    webhook_max_attempts: int = field(
        default=6, metadata={"help": "Deliveries of one webhook before it is failed"}
    )
    webhook_timeout_s: float = field(default=10.0, metadata={"help": "Seconds one webhook delivery may take"})
    webhook_backoff_s: float = field(
        default=1.0, metadata={"help": "Wait before the second delivery; doubles after each failure"}
    )
    webhook_max_backoff_s: float = field(
        default=60.0, metadata={"help": "Cap of the wait between deliveries"}
    )

    @property
    def adapter_names(self) -> list[str]:
        """The LoRA adapters served as model names, in --lora-modules order."""
        from qworker.lora.modules import parse_lora_modules

        return list(parse_lora_modules(self.lora_modules))

    @property
    def served_model_names(self) -> list[str]:
        """Every model name requests may use: the base model, then its adapters."""
        return [self.model, *(name for name in self.adapter_names if name != self.model)]

    def __post_init__(self) -> None:
        from qworker.lora.modules import parse_lora_modules

        parse_lora_modules(self.lora_modules)  # AdapterSettingsError (a ValueError) names the entry
        positive = {
            "port": self.port,
            "request_timeout_s": self.request_timeout_s,
            "max_body_bytes": self.max_body_bytes,
            "block_size": self.block_size,
            "demand_interval_s": self.demand_interval_s,
            "max_inflight_requests": self.max_inflight_requests,
            "limit_concurrency": self.limit_concurrency,
            "header_timeout_s": self.header_timeout_s,
            "default_max_tokens": self.default_max_tokens,
            # issue 23
            "max_file_bytes": self.max_file_bytes,
            "max_file_rows": self.max_file_rows,
            "file_expiry_s": self.file_expiry_s,
            "batch_lease_s": self.batch_lease_s,
            "max_driven_batches": self.max_driven_batches,
            "max_batch_attempts": self.max_batch_attempts,
            "batch_part_max_age_s": self.batch_part_max_age_s,
            "webhook_max_attempts": self.webhook_max_attempts,
            "webhook_timeout_s": self.webhook_timeout_s,
            "webhook_backoff_s": self.webhook_backoff_s,
            "webhook_max_backoff_s": self.webhook_max_backoff_s,
        }
        for name, value in positive.items():
            if value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if self.retry_after_s < 0 or self.timeout_keep_alive_s < 0:
            raise ValueError("retry_after_s and timeout_keep_alive_s must be >= 0")
        if self.max_waiting_blocks is not None and self.max_waiting_blocks < 1:
            raise ValueError(f"max_waiting_blocks must be >= 1, got {self.max_waiting_blocks}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if not self.model:
            raise ValueError("model must be a non-empty name")
        from qworker.openai.reasoning import check_reasoning_parser
        from qworker.openai.tool_parsers import AUTO_PARSERS

        if self.tool_call_parser is not None and self.tool_call_parser not in AUTO_PARSERS:
            raise ValueError(
                f"tool_call_parser must be one of {', '.join(AUTO_PARSERS)}, got {self.tool_call_parser!r}"
            )
        check_reasoning_parser(self.reasoning_parser)
