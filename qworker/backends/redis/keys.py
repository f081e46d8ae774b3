"""The Redis key layout: the job stream and its entries, the result store's keys, and defaults.

Shared by the worker, the client and this backend's source, producer, result store, backlog
reader and dead-letter tools; kept in one place so that a producer in another language can follow
the same layout (docs/queues.md).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

# The job stream and its consumer group.
DEFAULT_STREAM = "qworker:jobs"
DEFAULT_GROUP = "qworker"
# Fields of one stream entry: the job id (so that a body that is not even JSON still has an id
# to fail) and the JSON body.
FIELD_JOB_ID = "id"
FIELD_BODY = "job"

# Result-store keys live under this prefix.
DEFAULT_RESULT_PREFIX = "qworker"
# A stored result lives this long (seconds); a client that never reads it does not leak memory.
DEFAULT_RESULT_TTL_S = 24 * 3600
# Delta streams are for live readers; they expire sooner and keep a bounded length.
DEFAULT_DELTA_TTL_S = 3600
DEFAULT_DELTA_MAXLEN = 10_000
# A cancel request waits this long for a worker to see it.
DEFAULT_CANCEL_TTL_S = 24 * 3600

# Fields of one delta-stream entry.
DELTA_FIELD_TEXT = "text"
DELTA_FIELD_TOKEN_IDS = "token_ids"
# Written once, after the result: tells a live reader to stop waiting.
DELTA_FIELD_DONE = "done"
# The first entry a second or later attempt of a job writes (value: the attempt number): a reader
# drops the text of earlier attempts, because the new one streams its text from the start.
DELTA_FIELD_ATTEMPT = "attempt"
# On a delta: the position of its first token in the job's output. On an attempt marker: the new
# attempt resumes after that many tokens and characters of what came before (docs/queues.md,
# "Resume from tokens"); a marker without them starts from zero.
DELTA_FIELD_POS = "pos"
DELTA_FIELD_RESUME_TOKENS = "resume_tokens"
DELTA_FIELD_RESUME_CHARS = "resume_chars"
# What went wrong in a job's latest attempt, for the dead-letter reason of a later one.
DEFAULT_LAST_ERROR_TTL_S = 24 * 3600


# A priority-lane entry's message id (Lease.message_id) is its entry id behind this, so that ids
# stay unique across the two streams (both take their ids from the server's clock).
HIGH_LANE_PREFIX = "high:"


# An affinity lane's entry gets `lane<i>:` in front of its entry id (see lanes.py).
LANE_PREFIX = "lane"


def lane_stream(stream: str, index: int, *, cluster: bool) -> str:
    """Affinity lane `index` of a job stream. On a cluster each lane is its own hash tag, so that
    the lanes spread over the nodes (the stream's tag braces dropped from the name)."""
    if not cluster:
        return f"{stream}:lane:{index}"
    return "{" + stream.replace("{", "").replace("}", "") + f":lane:{index}" + "}"


def lanes_config_key(stream: str) -> str:
    """The queue's lane count, set by its first producer or worker: a URL that says another is
    refused, since jobs would wait on lanes that nobody reads."""
    return f"{stream}:lanes"


def lane_workers_key(stream: str) -> str:
    """A sorted set of the workers reading the queue, scored by their last heartbeat (the
    server's clock, in ms): the live set that lane ownership is computed over."""
    return f"{stream}:workers"


def dead_letter_stream(stream: str) -> str:
    return f"{stream}:dead"


def high_lane_stream(stream: str) -> str:
    """The priority lane of a job stream: read before the stream itself (see docs/queues.md)."""
    return f"{stream}:high"


def result_key(prefix: str, job_id: str) -> str:
    return f"{prefix}:result:{job_id}"


def delta_stream_key(prefix: str, job_id: str) -> str:
    return f"{prefix}:deltas:{job_id}"


def cancel_key(prefix: str, job_id: str) -> str:
    return f"{prefix}:cancel:{job_id}"


def last_error_key(prefix: str, job_id: str) -> str:
    return f"{prefix}:lasterror:{job_id}"


def worker_stats_key(prefix: str, worker_name: str) -> str:
    """A worker's stats report; the keys under `{prefix}:worker:` are the live workers."""
    return f"{worker_stats_prefix(prefix)}{worker_name}"


def worker_stats_prefix(prefix: str) -> str:
    return f"{prefix}:worker:"


@dataclass(frozen=True)
class KeyLayout:
    """Where one deployment's keys live. A single server (redis://, Sentinel) keeps the names
    above unchanged. A cluster (redis+cluster://) puts hash tags in them, so that every multi-key
    command and script stays within one slot: a queue's stream, lane and dead letters share
    `{stream}`, and a job's result, deltas, cancel flag and last error share `{job_id}`
    (docs/WORKER.md, "Redis Cluster and Sentinel")."""

    hash_tags: bool

    def stream(self, name: str) -> str:
        """The key of a job stream named `name` (its lane and dead letters follow from it)."""
        if not self.hash_tags or _has_hash_tag(name):
            return name
        return "{" + name + "}"

    def job(self, job_id: str) -> str:
        """The job's part of its keys: a hash tag on a cluster. A job id with braces of its own
        would end the tag early (or make an empty one that tags nothing), so its digest is the
        tag; it stays the same for every key of the job."""
        if not self.hash_tags:
            return job_id
        if "{" in job_id or "}" in job_id:
            return "{" + hashlib.blake2b(job_id.encode(), digest_size=12).hexdigest() + "}" + job_id
        return "{" + job_id + "}"


SINGLE_SERVER = KeyLayout(hash_tags=False)
CLUSTER = KeyLayout(hash_tags=True)


def _has_hash_tag(key: str) -> bool:
    """Whether Redis Cluster hashes `key` by a tag: a non-empty {...} (its first { and the next })."""
    start = key.find("{")
    end = key.find("}", start + 1) if start != -1 else -1
    return end > start + 1
