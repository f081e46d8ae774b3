"""The workers' stats reports in a Redis result store (`{prefix}:worker:{name}`, written by each
worker every stats_interval_s and expiring 30 s after it stops): what the pool-demand exporter
knows of the running work."""

from __future__ import annotations

import json
import logging
from typing import Any

from qworker.backends.backlog import WorkerReport, parse_worker_report
from qworker.backends.redis import keys
from qworker.utils import as_text

logger = logging.getLogger(__name__)


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def read_worker_reports(redis: Any, prefix: str = keys.DEFAULT_RESULT_PREFIX) -> list[WorkerReport]:
    """The reports of every worker whose stats key has not expired."""
    key_prefix = keys.worker_stats_prefix(prefix)
    stats_keys = list(redis.scan_iter(match=_glob_escape(key_prefix) + "*", count=500))
    if not stats_keys:
        return []
    reports = []
    # GETs in a pipeline, not one MGET: on a cluster the reports sit in many slots.
    pipe = redis.pipeline(transaction=False)
    for key in stats_keys:
        pipe.get(key)
    for key, payload in zip(stats_keys, pipe.execute(), strict=True):
        if payload is None:  # expired between SCAN and MGET
            continue
        try:
            report = parse_worker_report(as_text(key)[len(key_prefix) :], json.loads(payload))
        except (ValueError, KeyError, TypeError):
            logger.warning("unreadable worker stats under %s", as_text(key))
            continue
        if report is not None:
            reports.append(report)
    return reports
