"""Stream to X, final to Y: deltas and job notes (cancel flags, last errors, stats) in one store,
final results in another.

The usual pairing is S3 (or a Celery result backend) for results, which do not stream, and Redis
for the live token stream and cancel flags:

    qworker worker --queue sqs://jobs --results s3://bucket/results --stream-results redis://host:6379/0
    Client(queue="sqs://jobs", results="s3://bucket/results", stream_results="redis://host:6379/0")

The final store alone decides "exactly one result per id"; the stream store only gets a done marker
after the result is stored, so a live reader stops.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from qworker.backends.sink import Delta, Progress, ResultSink
from qworker.jobs.job import JobResult


class SplitSink(ResultSink):
    def __init__(self, final: ResultSink, stream: ResultSink) -> None:
        self.final = final
        self.stream = stream

    def write_deltas(self, deltas: list[Delta]) -> None:
        self.stream.write_deltas(deltas)

    def write_result(self, result: JobResult) -> bool:
        is_stored = self.final.write_result(result)
        self.stream.end_deltas(result.id, result.status.value)
        return is_stored

    def end_deltas(self, job_id: str, status: str) -> None:
        self.stream.end_deltas(job_id, status)

    def has_result(self, job_id: str) -> bool:
        return self.final.has_result(job_id)

    def get_result(self, job_id: str) -> JobResult | None:
        return self.final.get_result(job_id)

    def read_deltas(self, job_id: str, timeout_s: float | None) -> Iterator[Delta]:
        return self.stream.read_deltas(job_id, timeout_s)

    def read_progress(self, job_id: str) -> Progress | None:
        return self.stream.read_progress(job_id)

    def delete_result(self, job_id: str) -> None:
        self.final.delete_result(job_id)
        self.stream.delete_result(job_id)

    def request_cancel(self, job_id: str) -> None:
        self.stream.request_cancel(job_id)

    def cancelled_ids(self, job_ids: list[str]) -> set[str]:
        return self.stream.cancelled_ids(job_ids)

    def write_last_errors(self, job_id_to_error: dict[str, str]) -> None:
        self.stream.write_last_errors(job_id_to_error)

    def last_error(self, job_id: str) -> str | None:
        return self.stream.last_error(job_id)

    def write_worker_stats(self, worker_name: str, stats: Any) -> None:
        self.stream.write_worker_stats(worker_name, stats)

    def close(self) -> None:
        self.final.close()
        self.stream.close()
