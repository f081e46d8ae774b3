"""The Celery backend's key layout on the broker's Redis: the queue list and kombu's unacked
keys (per queue, not kombu's broker-wide defaults, so that Celery workers on the same broker and
qworker workers never restore each other's messages), and qworker's own keys beside them."""

from __future__ import annotations

DEFAULT_QUEUE = "qworker"
# The Celery task qworker serves: app.send_task(TASK_NAME, kwargs=job, queue=...).
TASK_NAME = "qworker.generate"
# Celery's Redis result backend keeps a task's meta under this prefix (and PUBLISHes it there).
TASK_META_PREFIX = "celery-task-meta-"


def unacked_key(queue: str) -> str:
    """kombu's hash of the messages taken but not acked: delivery tag -> [envelope, exchange, key]."""
    return f"{queue}.unacked"


def unacked_index_key(queue: str) -> str:
    """kombu's sorted set of delivery tags by the time they were taken (what expires a lease)."""
    return f"{queue}.unacked_index"


def unacked_mutex_key(queue: str) -> str:
    return f"{queue}.unacked_mutex"


def dead_letter_list(queue: str) -> str:
    """qworker's dead letters of the queue: JSON records (reason, task id, the envelope), LPUSHed."""
    return f"{queue}.dead"


def deliveries_key(queue: str) -> str:
    """Deliveries per task id (kombu keeps no delivery count)."""
    return f"{queue}.deliveries"


def task_meta_key(task_id: str) -> str:
    return f"{TASK_META_PREFIX}{task_id}"


def transport_options(queue: str, lease_timeout_s: float) -> dict[str, str | float]:
    """kombu's Redis transport options for `queue`."""
    return {
        "visibility_timeout": lease_timeout_s,
        "unacked_key": unacked_key(queue),
        "unacked_index_key": unacked_index_key(queue),
        "unacked_mutex_key": unacked_mutex_key(queue),
    }
