"""Whether a pool's workers run batch-invariant, read from their stats reports in the result store:
`qworker batch --queue` warns when one does not, and the gateway's batch driver says so in the batch
object, because such a worker's rows may differ from a local run (see docs/reproducibility.md)."""

from __future__ import annotations

import json
from typing import Any

# The batch object's metadata key that carries the warning (metadata values: at most 512 chars).
INVARIANCE_WARNING_KEY = "qworker_warning"


def workers_without_invariance(sink: Any) -> list[str] | None:
    """Names of the live workers whose stats show batch_invariant off (or no such field: an older
    worker); None where the result store keeps no worker stats this can read."""
    redis = getattr(sink, "redis", None)
    prefix = getattr(sink, "prefix", None)
    if redis is None or prefix is None:
        return None
    from qworker.backends.redis import keys

    key_prefix = keys.worker_stats_prefix(prefix)
    names = []
    for key in redis.scan_iter(match=key_prefix.replace("*", "\\*") + "*", count=500):
        payload = redis.get(key)
        if payload is None:
            continue
        name = (key.decode() if isinstance(key, bytes) else key)[len(key_prefix) :]
        try:
            hardware = json.loads(payload).get("hardware") or {}
        except (ValueError, AttributeError):
            continue
        if not hardware.get("batch_invariant", False):
            names.append(name)
    return sorted(names)


def invariance_warning(sink: Any) -> str | None:
    """The warning for a batch run on this pool now, None when every live worker is invariant or
    the store keeps no stats this can read."""
    names = workers_without_invariance(sink)
    if not names:
        return None
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    return (f"workers {shown} run without --batch-invariant: rows may differ from a local qworker batch run")[
        :512
    ]
