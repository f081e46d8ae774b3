"""What one request went through in a benchmark run: the raw trace every metric is computed from."""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

# The latency percentiles a report gives unless asked for others (`--percentiles`).
DEFAULT_PERCENTILES: tuple[float, ...] = (90.0, 99.0)


class RequestStatus(str, Enum):
    COMPLETED = "completed"
    FAILED = "failed"
    TIMEOUT = "timeout"


@dataclass
class RequestRecord:
    """Timestamps are seconds since the run started (a monotonic clock).

    `chunk_times` holds the time each streamed chunk appeared. In engine mode a chunk is one
    token; in queue mode it is one text delta, which may carry several tokens, so ITLs are
    per chunk, as in vLLM's `bench serve`.
    """

    request_id: str
    prompt_len: int
    output_len: int  # the number of tokens asked for
    arrival_time: float  # when the request was sent
    status: RequestStatus | None = None
    chunk_times: list[float] = field(default_factory=list)
    num_output_tokens: int = 0  # tokens actually generated (and counted) for this request
    finish_time: float | None = None
    start_time: float | None = None  # first scheduled / batch start, when the system says
    queue_wait_s: float | None = None  # queue mode: time on the queue before a worker took it
    error: str | None = None
    # Queue mode, from the stored result: prompt tokens the worker's prefix cache held when the
    # job was first scheduled (usage.prompt_tokens_details.cached_tokens), and which worker ran it.
    num_cached_tokens: int | None = None
    worker: str | None = None

    def add_chunk(self, t: float, num_tokens: int = 1) -> None:
        self.chunk_times.append(t)
        self.num_output_tokens += num_tokens

    def finish(self, status: RequestStatus, t: float, error: str | None = None) -> None:
        assert self.status is None, f"request {self.request_id} finished twice"
        self.status = status
        self.finish_time = t
        self.error = error

    @property
    def is_completed(self) -> bool:
        return self.status is RequestStatus.COMPLETED

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.arrival_time if self.chunk_times else None

    @property
    def e2el(self) -> float | None:
        return self.finish_time - self.arrival_time if self.finish_time is not None else None

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first (vLLM: (e2el - ttft) / (tokens - 1)).

        None with fewer than two tokens.
        """
        ttft, e2el = self.ttft, self.e2el
        if ttft is None or e2el is None or self.num_output_tokens < 2:
            return None
        return (e2el - ttft) / (self.num_output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.chunk_times)]

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["status"] = self.status.value if self.status is not None else None
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RequestRecord:
        data = dict(data)
        status = data.pop("status")
        record = cls(**data)
        record.status = RequestStatus(status) if status is not None else None
        return record
