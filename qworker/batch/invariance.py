"""Batch invariance for `qworker batch`: a local run turns it on (on the CPU; on CUDA the mode is
built but not yet checked on a GPU), so that a row's greedy output does not depend on which rows
shared its steps; a pool run cannot choose for the workers, so it warns when a live worker reports
the mode off (its stats carry `hardware.batch_invariant`). See docs/reproducibility.md."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from qworker.config import EngineConfig
from qworker.openai.batches.invariance import workers_without_invariance

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
