"""The pool's recent history, for the dashboard's chart: a bounded ring buffer of samples (queue
depth, KV demand, capacity, workers) in the Redis result store, so that gateway replicas stay
stateless and every one of them draws the same hour.

    {prefix}:dash:history        list of JSON samples, newest first, at most `max_samples`
    {prefix}:dash:history:slot   SET NX PX interval: whoever writes first in an interval writes

Writers: the pool-demand exporter after each reading, and every dashboard server (a gateway
replica, `qworker dashboard`) from a background thread. The slot key makes them write about one
sample per interval together, however many there are.
"""

from __future__ import annotations

import json
import time
from typing import Any

DEFAULT_INTERVAL_S = 10.0
# One hour at the default interval.
DEFAULT_MAX_SAMPLES = 360


def history_key(prefix: str) -> str:
    return f"{prefix}:dash:history"


def record_sample(
    redis: Any,
    prefix: str,
    sample: dict[str, Any],
    *,
    interval_s: float = DEFAULT_INTERVAL_S,
    max_samples: int = DEFAULT_MAX_SAMPLES,
) -> bool:
    """Append `sample` (with its time `t`) unless another writer did within this interval;
    whether it was written."""
    key = history_key(prefix)
    if not redis.set(f"{key}:slot", "1", nx=True, px=max(1, int(interval_s * 1000 * 0.9))):
        return False
    payload = json.dumps({"t": sample.get("t", time.time()), **sample})
    pipe = redis.pipeline(transaction=False)
    pipe.lpush(key, payload)
    pipe.ltrim(key, 0, max_samples - 1)
    # Gone an hour after the last writer stopped: no stale chart for a pool that was removed.
    pipe.expire(key, int(max(3600, interval_s * max_samples)))
    pipe.execute()
    return True


def read_history(redis: Any, prefix: str, since_s: float = 3600.0) -> list[dict[str, Any]]:
    """Samples of the last `since_s` seconds, oldest first."""
    cutoff = time.time() - since_s
    samples = []
    for raw in redis.lrange(history_key(prefix), 0, -1):
        try:
            sample = json.loads(raw)
        except ValueError:
            continue
        if isinstance(sample, dict) and isinstance(sample.get("t"), (int, float)) and sample["t"] >= cutoff:
            samples.append(sample)
    samples.sort(key=lambda s: s["t"])
    return samples
