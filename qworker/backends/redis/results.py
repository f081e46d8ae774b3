"""Result store on Redis.

- Deltas: XADD to `{prefix}:deltas:{id}` with an approximate MAXLEN and a TTL, one pipeline per
  engine step. A final entry with a `done` field tells live readers the result is stored. An
  entry with an `attempt` field opens a new attempt (after a redelivery): what came before it is
  superseded, and readers drop it, or, with `resume_tokens` and `resume_chars`, keep that much
  of it. Each delta's `pos` is its first token's place in the output: the stream is the job's
  checkpoint, which a later attempt resumes from (`read_progress`, docs/queues.md).
- Last errors: `SET {prefix}:lasterror:{id} <text> EX 1 day`, read back when a later attempt
  dead-letters the job.
- Result: `SET {prefix}:result:{id} <json> NX EX ttl`. NX makes the first writer win, so a job
  that two workers ran (a lease lost during a stall) still has exactly one result.
- Job notes: cancel flags `{prefix}:cancel:{id}` (with a TTL) and worker stats
  `{prefix}:worker:{name}` (expiring 30 s after the worker stops reporting). Key names: keys.py.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

from qworker.backends.redis import keys
from qworker.backends.redis.connection import (
    NO_WAIT,
    URL_PARAMS,
    Durability,
    durability,
    key_layout,
    parse_redis_url,
    worker_client,
)
from qworker.backends.sink import Delta, Progress, ResultSink, ResumePoint, latest_attempt, progress_of
from qworker.backends.urls import InvalidURLError, redact_url, url_number, url_scheme
from qworker.jobs.job import JobResult

# A live reader wakes at least this often to check for a result written without a done marker
# reaching it (its delta stream expired or was trimmed).
READ_POLL_S = 1.0
WORKER_STATS_TTL_S = 30


class RedisResultSink(ResultSink):
    def __init__(
        self,
        redis: Any,
        *,
        prefix: str = keys.DEFAULT_RESULT_PREFIX,
        result_ttl_s: int = keys.DEFAULT_RESULT_TTL_S,
        delta_ttl_s: int = keys.DEFAULT_DELTA_TTL_S,
        delta_maxlen: int = keys.DEFAULT_DELTA_MAXLEN,
        layout: keys.KeyLayout = keys.SINGLE_SERVER,
        durable: Durability = NO_WAIT,
        connection_url: str | None = None,
    ) -> None:
        self.redis = redis
        # The URL `redis` was opened from, for an asyncio reader of the same store
        # (delta_hub.py); None where there is none to give (a cluster, Sentinel, a test's client).
        self.connection_url = connection_url
        self.layout = layout
        self.durable = durable
        self.prefix = prefix
        self.result_ttl_s = result_ttl_s
        self.delta_ttl_s = delta_ttl_s
        self.delta_maxlen = delta_maxlen
        # Jobs whose delta stream has its TTL set; forgotten when the result is written.
        self._has_expiry: set[str] = set()

    def write_deltas(self, deltas: list[Delta]) -> None:
        if not deltas:
            return
        pipe = self.redis.pipeline(transaction=False)
        for delta in deltas:
            key = self._key(keys.delta_stream_key, delta.job_id)
            fields: dict[str, Any]
            if delta.attempt is not None:
                fields = {keys.DELTA_FIELD_ATTEMPT: delta.attempt}
                if delta.resume is not None:
                    fields[keys.DELTA_FIELD_RESUME_TOKENS] = delta.resume.num_tokens
                    fields[keys.DELTA_FIELD_RESUME_CHARS] = delta.resume.num_chars
            else:
                fields = {
                    keys.DELTA_FIELD_TEXT: delta.text,
                    keys.DELTA_FIELD_TOKEN_IDS: json.dumps(delta.token_ids),
                }
                if delta.pos is not None:
                    fields[keys.DELTA_FIELD_POS] = delta.pos
            pipe.xadd(key, fields, maxlen=self.delta_maxlen, approximate=True)
            if delta.job_id not in self._has_expiry:
                # Once per job: EXPIRE on every token would double the commands per step.
                pipe.expire(key, self.delta_ttl_s)
                self._has_expiry.add(delta.job_id)
        pipe.execute()

    def write_result(self, result: JobResult) -> bool:
        self._has_expiry.discard(result.id)
        key = self._key(keys.result_key, result.id)
        deltas_key = self._key(keys.delta_stream_key, result.id)
        pipe = self.redis.pipeline(transaction=True)
        pipe.set(key, result.model_dump_json(), nx=True, ex=self.result_ttl_s)
        pipe.xadd(deltas_key, {keys.DELTA_FIELD_DONE: result.status.value}, maxlen=self.delta_maxlen)
        pipe.expire(deltas_key, self.delta_ttl_s)
        is_stored, _, _ = pipe.execute()
        self.durable.wait(self.redis)
        return bool(is_stored)

    def end_deltas(self, job_id: str, status: str) -> None:
        self._has_expiry.discard(job_id)
        key = self._key(keys.delta_stream_key, job_id)
        pipe = self.redis.pipeline(transaction=True)
        pipe.xadd(key, {keys.DELTA_FIELD_DONE: status}, maxlen=self.delta_maxlen)
        pipe.expire(key, self.delta_ttl_s)
        pipe.execute()

    def has_result(self, job_id: str) -> bool:
        return bool(self.redis.exists(self._key(keys.result_key, job_id)))

    def get_result(self, job_id: str) -> JobResult | None:
        raw = self.redis.get(self._key(keys.result_key, job_id))
        return JobResult.model_validate_json(raw) if raw is not None else None

    def read_deltas(self, job_id: str, timeout_s: float | None) -> Iterator[Delta]:
        """The job's deltas and attempt markers. What is already in the stream is read at once,
        from its latest attempt marker on: text that a later attempt superseded is never yielded
        (the stream holds at most about `delta_maxlen` entries)."""
        key = self._key(keys.delta_stream_key, job_id)
        last_id: Any = "0-0"
        last_progress = time.monotonic()
        backlog = self.redis.xrange(key, "-", "+")
        if backlog:
            last_id = backlog[-1][0]
            parsed = [parse_delta(job_id, fields) for _, fields in backlog]
            ended = next((i for i, delta in enumerate(parsed) if delta is None), None)
            yield from latest_attempt([d for d in parsed[:ended] if d is not None])
            if ended is not None:
                return
            last_progress = time.monotonic()
        while True:
            wait_s = READ_POLL_S
            if timeout_s is not None:
                wait_s = min(wait_s, max(0.001, timeout_s - (time.monotonic() - last_progress)))
            reply = self.redis.xread({key: last_id}, count=256, block=max(1, int(wait_s * 1000)))
            for _key, entries in reply or []:
                for entry_id, fields in entries:
                    last_id = entry_id
                    delta = parse_delta(job_id, fields)
                    if delta is None:
                        return
                    yield delta
                last_progress = time.monotonic()
            if not reply:
                if self.has_result(job_id):
                    return
                if timeout_s is not None and time.monotonic() - last_progress >= timeout_s:
                    raise TimeoutError(f"no output from job {job_id} for {timeout_s:.1f}s")

    def read_progress(self, job_id: str) -> Progress:
        """The job's deltas as progress (sink.progress_of), in one XRANGE. An entry that does not
        parse makes a problem: the job then starts from zero."""
        deltas = []
        for entry_id, fields in self.redis.xrange(self._key(keys.delta_stream_key, job_id), "-", "+"):
            try:
                delta = parse_delta(job_id, fields)
            except (KeyError, ValueError, TypeError, UnicodeDecodeError) as exc:
                name = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                return Progress(problem=f"delta entry {name} does not parse: {type(exc).__name__}: {exc}")
            if delta is None:
                break  # the done marker: an attempt stored a result
            deltas.append(delta)
        return progress_of(deltas)

    def request_cancel(self, job_id: str) -> None:
        self.redis.set(self._key(keys.cancel_key, job_id), b"1", ex=keys.DEFAULT_CANCEL_TTL_S)

    def cancelled_ids(self, job_ids: list[str]) -> set[str]:
        if not job_ids:
            return set()
        # GETs in a pipeline, not one MGET: on a cluster each flag sits in its job's slot.
        pipe = self.redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.get(self._key(keys.cancel_key, job_id))
        flags = pipe.execute()
        return {job_id for job_id, flag in zip(job_ids, flags, strict=True) if flag is not None}

    def write_last_errors(self, job_id_to_error: dict[str, str]) -> None:
        if not job_id_to_error:
            return
        pipe = self.redis.pipeline(transaction=False)
        for job_id, error in job_id_to_error.items():
            text = error.encode("utf-8", "backslashreplace")
            pipe.set(self._key(keys.last_error_key, job_id), text, ex=keys.DEFAULT_LAST_ERROR_TTL_S)
        pipe.execute()

    def last_error(self, job_id: str) -> str | None:
        raw = self.redis.get(self._key(keys.last_error_key, job_id))
        return raw.decode("utf-8", "replace") if raw is not None else None

    def write_worker_stats(self, worker_name: str, stats: Any) -> None:
        key = keys.worker_stats_key(self.prefix, worker_name)
        payload = json.dumps(dataclasses.asdict(stats))
        # Expires soon after the worker stops reporting: the set of keys is the set of live workers.
        self.redis.set(key, payload, ex=WORKER_STATS_TTL_S)

    def delete_result(self, job_id: str) -> None:
        self.redis.delete(*self._keys_of(job_id))

    def _key(self, key_of: Callable[[str, str], str], job_id: str) -> str:
        """A job's key in this store's layout (`key_of`: keys.result_key and its kin)."""
        return key_of(self.prefix, self.layout.job(job_id))

    def delta_key(self, job_id: str) -> str:
        return self._key(keys.delta_stream_key, job_id)

    def _keys_of(self, job_id: str) -> list[str]:
        """Every key a job has in this store (what delete_result removes)."""
        return [
            self._key(keys.delta_stream_key, job_id),
            self._key(keys.last_error_key, job_id),
            self._key(keys.result_key, job_id),
        ]

    def close(self) -> None:
        self.redis.close()


def parse_delta(job_id: str, fields: dict[bytes, bytes]) -> Delta | None:
    """One delta-stream entry as a Delta (or an attempt marker); None for the done marker."""
    if keys.DELTA_FIELD_DONE.encode() in fields:
        return None
    attempt = fields.get(keys.DELTA_FIELD_ATTEMPT.encode())
    if attempt is not None:
        resume = None
        num_tokens = fields.get(keys.DELTA_FIELD_RESUME_TOKENS.encode())
        if num_tokens is not None:
            resume = ResumePoint(int(num_tokens), int(fields[keys.DELTA_FIELD_RESUME_CHARS.encode()]))
        return Delta(job_id, "", [], attempt=int(attempt), resume=resume)
    pos = fields.get(keys.DELTA_FIELD_POS.encode())
    return Delta(
        job_id,
        fields[keys.DELTA_FIELD_TEXT.encode()].decode(),
        json.loads(fields[keys.DELTA_FIELD_TOKEN_IDS.encode()]),
        pos=int(pos) if pos is not None else None,
    )


def open_sink(url: str) -> RedisResultSink:
    # A Redis URL may serve as queue and results at once: the source's parameters are accepted.
    parsed = parse_redis_url(url, URL_PARAMS)
    layout = key_layout(url)
    prefix = parsed.params.get("prefix", keys.DEFAULT_RESULT_PREFIX)
    is_one_server = url_scheme(parsed.connection_url) in ("redis", "rediss", "unix")
    if layout.hash_tags and ("{" in prefix or "}" in prefix):
        raise InvalidURLError(
            f"prefix={prefix!r} in {redact_url(url)!r} has braces; "
            "on a cluster each job's id is its keys' hash tag"
        )
    return RedisResultSink(
        worker_client(parsed.connection_url),
        prefix=prefix,
        result_ttl_s=int(url_number(parsed.params, "result_ttl_s", keys.DEFAULT_RESULT_TTL_S)),
        delta_ttl_s=int(url_number(parsed.params, "delta_ttl_s", keys.DEFAULT_DELTA_TTL_S)),
        delta_maxlen=int(url_number(parsed.params, "delta_maxlen", keys.DEFAULT_DELTA_MAXLEN)),
        layout=layout,
        durable=durability(parsed),
        connection_url=parsed.connection_url if layout is keys.SINGLE_SERVER and is_one_server else None,
    )
