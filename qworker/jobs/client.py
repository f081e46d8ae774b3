"""The client: submit jobs, stream their tokens, wait for results, cancel.

from qworker import Client
client = Client(queue="redis://127.0.0.1:6379/0?stream=jobs", results="redis://127.0.0.1:6379/0")
job_id = client.submit({"messages": [{"role": "user", "content": "Hi"}], "params": {"max_tokens": 32}})
for text in client.stream(job_id):
    print(text, end="")
print(client.result(job_id, timeout=60).status)

SQS with results in S3 and the live token stream in Redis ("stream to X, final to Y"):
client = Client(queue="sqs://jobs?region=eu-west-1", results="s3://bucket/results",
                stream_results="redis://127.0.0.1:6379/0")
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any

from qworker.backends.connections import (
    default_results_url,
    open_producer,
    open_sink,
    resolve_url,
    s3_location_of_results,
)
from qworker.backends.source import OutgoingJob
from qworker.errors import QworkerError
from qworker.jobs.affinity import affinity_key
from qworker.jobs.job import Job, JobResult
from qworker.jobs.pooling_job import AnyJob, PoolingJob, decode_vector, encode_any_job
from qworker.jobs.text_follower import TextFollower


class JobFailedError(QworkerError):
    """A job that a helper waited on (Client.embed) ended without completing: its result says why."""

    def __init__(self, result: JobResult) -> None:
        reason = (
            f"{result.error.type}: {result.error.message}" if result.error is not None else "no error given"
        )
        super().__init__(f"job {result.id} ended {result.status.value}: {reason}")
        self.result = result


class Client:
    def __init__(
        self, queue: str | None = None, results: str | None = None, stream_results: str | None = None
    ) -> None:
        """`queue` and `results` are URLs (see connections.py). With none, the embedded Redis
        server serves both; with only `queue`, results live on the same server (an sqs:// queue
        needs `results`). `stream_results` puts live deltas and cancel flags in another store than
        the final results (e.g. results in S3, the token stream in Redis). Jobs too large for an
        SQS message go to S3 behind a pointer: under the results prefix when results are in S3,
        else where the queue URL's `payload_s3` says."""
        queue_url = resolve_url(queue)
        results_url = results or default_results_url(queue_url)
        self.producer = open_producer(queue_url, payload_location=s3_location_of_results(results_url))
        self.sink = open_sink(results_url, stream_results)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.producer.close()
        self.sink.close()

    @staticmethod
    def _as_job(job: AnyJob | dict[str, Any] | str) -> AnyJob:
        if isinstance(job, Job | PoolingJob):
            return job
        if isinstance(job, str):
            return Job(prompt=job)
        # A dict naming a task is a pooling job (jobs/pooling_job.py), as on the wire.
        return PoolingJob.model_validate(job) if "task" in job else Job.model_validate(job)

    def submit(self, job: AnyJob | dict[str, Any] | str, group_id: str | None = None) -> str:
        """Validate and enqueue one job (a Job, its dict, or a prompt string). Returns its id.

        `group_id` is the ordering group on an SQS FIFO queue (default: the job id)."""
        return self.submit_many([job], group_id=group_id)[0]

    def submit_many(
        self, jobs: Iterable[AnyJob | dict[str, Any] | str], group_id: str | None = None
    ) -> list[str]:
        """Validate every job first, then enqueue them all (in as few round trips as the queue
        allows). Returns their ids."""
        validated = [self._as_job(job) for job in jobs]
        self.producer.send(
            [
                OutgoingJob(
                    job.id,
                    encode_any_job(job),
                    group_id,
                    job.priority,
                    affinity_key(job) if isinstance(job, Job) else job.affinity,
                )
                for job in validated
            ]
        )
        return [job.id for job in validated]

    def embed(
        self,
        input: str | list[str] | list[int] | list[list[int]],
        timeout: float | None = None,
        **fields: Any,
    ) -> list[list[float]]:
        """Embed `input` (one vector per input, in order) on the pool: submit an embed job, wait
        for its result. `fields` are the job's others (dimensions, normalize, truncate_prompt_tokens,
        priority, ...). Raises JobFailedError when the job does not complete, TimeoutError after
        `timeout` seconds."""
        job_id = self.submit(PoolingJob(task="embed", input=input, **fields))
        result = self.result(job_id, timeout=timeout)
        if result.pooled is None:
            raise JobFailedError(result)
        return [decode_vector(item.data) for item in result.pooled]

    def stream(self, job_id: str, timeout: float | None = None) -> Iterator[str]:
        """Yield the job's text deltas as the worker generates them, until its result is stored.
        The text yielded, joined, is the stored result's text.

        A job runs again when its worker died or released it: the new attempt streams from the
        start, after an attempt marker, or resumes after what the earlier ones streamed (a resume
        marker says how many characters it keeps; docs/queues.md "Resume from tokens"). Text
        yielded before the marker is not repeated: the new attempt's text is followed silently
        until it passes what was yielded, and only the rest is yielded (a rerun draws the same
        tokens: the same seed, or greedy). Should the new text differ from what was yielded,
        this raises StreamRestartedError; stream again to read the latest attempt from its start.

        Raises TimeoutError when no output arrives for `timeout` seconds.
        """
        follower = TextFollower(job_id)
        for delta in self.sink.read_deltas(job_id, timeout):
            text = follower.feed(delta)
            if text:
                yield text
        follower.finish()

    def result(self, job_id: str, timeout: float | None = None) -> JobResult:
        """Wait for the job's stored result. Raises TimeoutError after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        wait_s = 0.005
        while True:
            result = self.sink.get_result(job_id)
            if result is not None:
                return result
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"no result for job {job_id} within {timeout}s")
            # Back off to 200 ms: cheap for one job, gentle for a client waiting on thousands.
            time.sleep(wait_s if deadline is None else max(0.0, min(wait_s, deadline - time.monotonic())))
            wait_s = min(0.2, wait_s * 1.5)

    def results(self, job_ids: Iterable[str], timeout: float | None = None) -> list[JobResult]:
        """Wait for several results (in the order of `job_ids`); `timeout` covers them all."""
        deadline = None if timeout is None else time.monotonic() + timeout
        out = []
        for job_id in job_ids:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            out.append(self.result(job_id, timeout=left))
        return out

    def cancel(self, job_id: str) -> None:
        """Ask for the job to stop, queued or running. Its result gets status `cancelled`."""
        self.sink.request_cancel(job_id)

    def queue_depth(self) -> int | None:
        return self.producer.queue_depth()
