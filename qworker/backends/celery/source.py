"""Job source on a Celery queue over the Redis broker, read directly with kombu.

A service that uses Celery enqueues `app.send_task("qworker.generate", kwargs=job, queue="qworker")`.
qworker takes those Celery protocol v2 messages from the broker itself (not through Celery's worker
pool), so continuous batching and admission by free KV blocks still apply, and writes the result
in Celery's Redis result-backend format (results.py), so `AsyncResult(task_id).get()` works.

- lease: kombu's Redis transport: RPOP from the queue list, and the message goes into the unacked
  hash with a timestamp (late ack: nothing is removed for good until `ack`). Every second, and
  whenever the queue is empty, messages whose timestamp is older than `lease_timeout_s` (kombu's
  `visibility_timeout`) are put back on the queue: that is how a killed worker's jobs come back.
- extend: the message's timestamp in the unacked index is reset, only while the message is still
  ours (a Lua script), so a held job is never restored under a running worker.
- ack: basic_ack. release: basic_reject(requeue=True). dead_letter: the message's envelope and
  the reason go to the list `{queue}.dead`, then the message is acked.
- delivery count: kombu keeps none; a hash `{queue}.deliveries` counts leases per task id.

Celery's own controls, read from the message headers and the control broadcast:
- `expires` (header, ISO 8601): a task taken after it gets a cancelled result (REVOKED) unrun.
- `eta` / `countdown` (header `eta`): the message is leased but held back here, its lease
  extended, until its time; it does not count against the worker's backlog, so other jobs run.
- `time_limit` / `soft_time_limit` (header `timelimit` = [hard, soft]): the job's deadline is
  the hard limit, else the soft one; a job that runs past it ends with a timeout result
  (FAILURE, TimeLimitExceeded). A soft limit is not a separate warning here.
- `revoke()`: Celery broadcasts it on the `celery.pidbox` fanout exchange, which kombu's Redis
  transport PUBLISHes on a channel ending in `celery.pidbox`. The source subscribes to that
  pattern and remembers revoked task ids (at most REVOKED_MAX, for REVOKED_TTL_S); the worker
  cancels a revoked job, queued or running, at its next cancel check. A revoke broadcast while no
  worker listens is missed, as it is by Celery's workers that start later (Celery's workers
  catch up through their peers; qworker's do not).

Security: the body is deserialized only when the content type is `application/json` (utf-8, no
compression). A message serialized with pickle (or yaml, msgpack, anything else) is never
decoded: it is dead-lettered with the reason, and its task gets a FAILURE result. Nobody who can
write to the broker can make the worker run code.

The unacked keys are per queue (`{queue}.unacked`, ...), not kombu's broker-wide defaults, so that
Celery workers on the same broker and qworker workers never restore each other's messages.
kombu's own window applies: a worker killed between the RPOP and the unacked write (microseconds)
loses that one message.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from qworker.backends.celery import keys
from qworker.backends.celery.holding import EtaHold, RevokedIds
from qworker.backends.celery.keys import TASK_NAME, transport_options
from qworker.backends.celery.url import parse_celery_url
from qworker.backends.source import JobSource, Lease
from qworker.backends.urls import url_number
from qworker.utils import as_text

logger = logging.getLogger(__name__)

ACCEPTED_CONTENT_TYPE = "application/json"
DEAD_LETTER_MAXLEN = 100_000
DELIVERY_COUNT_TTL_S = 7 * 24 * 3600
RESTORE_INTERVAL_S = 1.0
PIDBOX_PATTERN = "*celery.pidbox*"

# KEYS[1] unacked hash, KEYS[2] unacked index; ARGV[1] now, ARGV[2..] delivery tags.
# Returns the tags no longer held (restored by a peer after our lease expired).
_EXTEND_LUA = """
local lost = {}
for i = 2, #ARGV do
  if redis.call('HEXISTS', KEYS[1], ARGV[i]) == 1 then
    redis.call('ZADD', KEYS[2], ARGV[1], ARGV[i])
  else
    table.insert(lost, ARGV[i])
  end
end
return lost
"""


class CelerySource(JobSource):
    def __init__(
        self,
        broker_url: str,
        *,
        queue: str = keys.DEFAULT_QUEUE,
        consumer: str,
        lease_timeout_s: float = 30.0,
        dead_letter: str | None = None,
    ) -> None:
        from kombu import Connection, Exchange, Queue

        self.queue = queue
        self.consumer = consumer
        self.lease_timeout_s = lease_timeout_s
        self.queue_name = f"celery:{queue}"
        self.dead_letter_list = dead_letter or keys.dead_letter_list(queue)
        self.deliveries_key = keys.deliveries_key(queue)
        self.connection = Connection(broker_url, transport_options=transport_options(queue, lease_timeout_s))
        self.channel = self.connection.channel()
        # Celery declares a missing queue as a direct exchange of the same name; so do we, so that
        # kombu finds the binding when it restores a message.
        Queue(queue, Exchange(queue, type="direct"), routing_key=queue)(self.channel).declare()
        self.redis = self.channel.client
        self._extend_script = self.redis.register_script(_EXTEND_LUA)
        self._last_restore = 0.0
        self._messages: dict[str, Any] = {}
        # delivery tag -> eta (Unix seconds) of a message just taken, for _defer.
        # Leased messages whose eta is still ahead: (eta, lease), and when they were last extended.
        self._eta_hold = EtaHold()
        self._held_extended_at = time.monotonic()
        # task id -> when its revoke was heard (monotonic), oldest first.
        self._revoked = RevokedIds()
        self._pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        self._pubsub.psubscribe(PIDBOX_PATTERN)

    # -- lease -------------------------------------------------------------------------------

    def _restore_expired(self) -> None:
        self._last_restore = time.monotonic()
        self.channel.qos.restore_visible(num=100, interval=1)

    def lease(self, max_count: int, block_s: float, *, is_idle: bool = True) -> list[Lease]:
        if max_count <= 0:
            return []
        if time.monotonic() - self._last_restore >= RESTORE_INTERVAL_S:
            self._restore_expired()
        deadline = time.monotonic() + block_s
        leases: list[Lease] = self._due_held(max_count)
        while len(leases) < max_count:
            lease = self._get_one()
            if lease is not None:
                if not self._eta_hold.hold(lease):
                    leases.append(lease)
                continue
            if leases or time.monotonic() >= deadline:
                break
            self._restore_expired()
            time.sleep(0.02)
        return leases

    def _due_held(self, max_count: int) -> list[Lease]:
        """Held-back messages whose eta has come (earliest first); the others' leases extended."""
        due = self._eta_hold.take_due(max_count)
        if self._eta_hold and time.monotonic() - self._held_extended_at >= self.lease_timeout_s / 3:
            self._held_extended_at = time.monotonic()
            lost = {id(lease) for lease in self.extend(self._eta_hold.leases())}
            self._eta_hold.keep_only(lambda lease: id(lease) not in lost)
        return due

    def _get_one(self) -> Lease | None:
        from kombu.transport.virtual import Empty

        try:
            raw = self.channel._get(self.queue)
        except Empty:
            return None
        headers = dict(raw.get("headers") or {})
        content_type = raw.get("content-type")
        encoding = (raw.get("content-encoding") or "utf-8").lower()
        rejection = envelope_rejection(content_type, encoding, headers)
        if rejection is not None:
            # Never decompress or decode what we refuse: the Message gets the headers without it.
            headers.pop("compression", None)
            raw = {**raw, "headers": headers}
        message = self.channel.Message(raw, channel=self.channel)
        self.channel.qos.append(message, message.delivery_tag)
        tag = as_text(message.delivery_tag)
        self._messages[tag] = message
        task_id = headers.get("id")
        task_id = task_id if isinstance(task_id, str) and task_id else None
        delivery_count = 1
        if task_id is not None:
            pipe = self.redis.pipeline(transaction=False)
            pipe.hincrby(self.deliveries_key, task_id, 1)
            pipe.expire(self.deliveries_key, DELIVERY_COUNT_TTL_S)
            delivery_count = int(pipe.execute()[0])
        body = b""
        if rejection is None:
            body, rejection = self.job_body(message.body)
        eta = _header_time(headers.get("eta"))
        if eta is not None and rejection is None:
            self._eta_hold.note_eta(tag, eta)
        hard, soft = _time_limits(headers.get("timelimit"))
        return Lease(
            message_id=tag,
            body=body,
            job_id=task_id,
            delivery_count=delivery_count,
            enqueued_at=None,
            handle=tag,
            rejection=rejection,
            expires_at=_header_time(headers.get("expires")),
            time_limit_s=hard if hard is not None else soft,
        )

    @staticmethod
    def job_body(raw_body: Any) -> tuple[bytes, str | None]:
        """The job JSON from a protocol v2 body `[args, kwargs, embed]` (already known to be JSON).

        The job is the kwargs (send_task(..., kwargs=job)) or a lone dict argument (args=[job]).
        A body of another shape becomes a job that fails validation with a clear message."""
        data = raw_body.encode() if isinstance(raw_body, str) else raw_body
        try:
            payload = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            return b"", f"body is not valid JSON: {exc}"
        if not (isinstance(payload, list) and len(payload) == 3):
            return b"", "not a Celery protocol v2 body ([args, kwargs, embed])"
        args, kwargs, _embed = payload
        if not args and isinstance(kwargs, dict):
            return json.dumps(kwargs).encode(), None
        if isinstance(args, list) and len(args) == 1 and isinstance(args[0], dict) and not kwargs:
            return json.dumps(args[0]).encode(), None
        # Positional arguments have no field names: the job fails, saying so.
        return json.dumps({"positional_args": args, **(kwargs or {})}).encode(), None

    # -- holding and letting go --------------------------------------------------------------

    def extend(self, leases: list[Lease]) -> list[Lease]:
        if not leases:
            return []
        lost = self._extend_script(
            keys=[keys.unacked_key(self.queue), keys.unacked_index_key(self.queue)],
            args=[time.time(), *[le.handle for le in leases]],
        )
        lost_tags = {as_text(x) for x in lost}
        return [le for le in leases if le.handle in lost_tags]

    def _forget(self, lease: Lease) -> None:
        self._messages.pop(lease.message_id, None)
        if lease.job_id is not None:
            self.redis.hdel(self.deliveries_key, lease.job_id)

    def ack(self, lease: Lease) -> None:
        self.channel.basic_ack(lease.handle)
        self._forget(lease)

    def release(self, leases: list[Lease]) -> None:
        for lease in leases:
            self.channel.basic_reject(lease.handle, requeue=True)
            self._messages.pop(lease.message_id, None)

    def dead_letter(self, lease: Lease, reason: str) -> None:
        message = self._messages.get(lease.message_id)
        record = {
            "reason": reason,
            "task_id": lease.job_id,
            "delivery_count": lease.delivery_count,
            "queue": self.queue,
            "dead_at": time.time(),
            # The envelope as the broker held it: the body stays base64, never deserialized.
            "envelope": message._raw if message is not None else None,
        }
        pipe = self.redis.pipeline(transaction=False)
        pipe.lpush(self.dead_letter_list, json.dumps(record, default=str))
        pipe.ltrim(self.dead_letter_list, 0, DEAD_LETTER_MAXLEN - 1)
        pipe.execute()
        self.ack(lease)

    def num_pending(self) -> int | None:
        return len(self._messages)

    def revoked_ids(self, job_ids: list[str]) -> set[str]:
        self._hear_revokes()
        return {job_id for job_id in job_ids if job_id in self._revoked}

    def _hear_revokes(self) -> None:
        while True:
            message = self._pubsub.get_message(timeout=0)
            if message is None:
                break
            self._revoked.add(_revoked_task_ids(message.get("data")))

    def close(self) -> None:
        # Messages held back for their eta go back to the queue for whoever serves it next.
        for lease in self._eta_hold.leases():
            self.release([lease])
        self._eta_hold.clear()
        self._pubsub.close()
        try:
            self.channel.close()
        finally:
            self.connection.release()


def _header_time(value: Any) -> float | None:
    """Unix seconds of a Celery `eta`/`expires` header (ISO 8601; naive means UTC), or None."""
    from datetime import UTC, datetime

    if not isinstance(value, str) or not value:
        return None
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        logger.warning("ignoring a header time that is not ISO 8601: %r", value[:64])
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()


def _time_limits(value: Any) -> tuple[float | None, float | None]:
    """(hard, soft) seconds from Celery's `timelimit` header [hard, soft]."""
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        return None, None
    hard, soft = (float(v) if isinstance(v, (int, float)) and v > 0 else None for v in value)
    return hard, soft


def _revoked_task_ids(data: Any) -> list[str]:
    """The task ids of a pidbox broadcast when it is a revoke (kombu's envelope around Celery's
    {"method": "revoke", "arguments": {"task_id": id or [ids]}}); [] for anything else."""
    import base64

    try:
        envelope = json.loads(data)
        body = envelope["body"]
        if (envelope.get("properties") or {}).get("body_encoding") == "base64":
            body = base64.b64decode(body)
        if envelope.get("content-type") != ACCEPTED_CONTENT_TYPE:
            return []  # never deserialize anything else
        command = json.loads(body)
    except (ValueError, KeyError, TypeError):
        return []
    if not isinstance(command, dict) or command.get("method") != "revoke":
        return []
    task_ids = (command.get("arguments") or {}).get("task_id")
    task_ids = [task_ids] if isinstance(task_ids, str) else task_ids
    return [t for t in task_ids or [] if isinstance(t, str)]


def open_source(url: str, consumer: str, lease_timeout_s: float | None) -> CelerySource:
    broker_url, params = parse_celery_url(url)
    return CelerySource(
        broker_url,
        queue=params.get("queue", keys.DEFAULT_QUEUE),
        consumer=consumer,
        lease_timeout_s=lease_timeout_s or url_number(params, "lease_timeout_s", 30.0),
        dead_letter=params.get("dead_letter"),
    )


def envelope_rejection(content_type: str | None, encoding: str, headers: dict[str, Any]) -> str | None:
    """Why a Celery message is refused before its body is read (None: it is read). Shared by the
    Redis and AMQP transports, which carry the same protocol-2 envelope in different fields."""
    if content_type != ACCEPTED_CONTENT_TYPE or encoding not in ("utf-8", "utf8"):
        return (
            f"content type {content_type!r} ({encoding}) is not accepted; qworker takes only "
            f"{ACCEPTED_CONTENT_TYPE} (send with serializer='json'). The body was not deserialized."
        )
    if headers.get("compression"):
        return f"compressed messages ({headers['compression']!r}) are not accepted"
    if "task" not in headers:
        return "not a Celery protocol v2 message (no task header); qworker reads protocol 2"
    if headers["task"] != TASK_NAME:
        return f"task {headers['task']!r} is not served here; qworker serves {TASK_NAME!r}"
    return None
