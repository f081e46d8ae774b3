"""Batch invariance for `qworker batch`: a local run turns it on (on the CPU; on CUDA the mode is
built but not yet checked on a GPU), so that a row's greedy output does not depend on which rows
shared its steps; a pool run cannot choose for the workers, so it warns when a live worker reports
the mode off (its stats carry `hardware.batch_invariant`). See docs/reproducibility.md."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from typing import Any

from qworker.config import EngineConfig

logger = logging.getLogger(__name__)


def local_engine_config(config: EngineConfig) -> EngineConfig:
    """`config` with batch_invariant on, unless the device is CUDA (built there, not yet checked on
    a GPU: docs/reproducibility.md)."""
    if config.batch_invariant:
        return config
    if config.device.startswith("cuda") or (config.device == "auto" and _has_cuda()):
        logger.info("batch_invariant stays off on CUDA: rows may differ from a pool run in their last bits")
        return config
    return replace(config, batch_invariant=True)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


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


def warn_unless_pool_is_invariant(sink: Any) -> None:
    """Logs a warning when a live worker runs without batch invariance."""
    try:
        names = workers_without_invariance(sink)
    except Exception as exc:  # a warning's check must never fail the batch
        logger.debug("could not read the workers' stats: %s", exc)
        return
    if names:
        logger.warning(
            "workers %s run without --batch-invariant: a row's output may differ from a local run "
            "(and a redelivered row from its first attempt)",
            ", ".join(names),
        )
