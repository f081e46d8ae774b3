"""botocore's failures on SQS calls, read as ../aws_errors.py reads every AWS client's (the
missing-queue codes, QueueDoesNotExist and AWS.SimpleQueueService.NonExistentQueue, among them)."""

from __future__ import annotations

from qworker.backends.aws_errors import LIBRARIES, translate_error

__all__ = ["LIBRARIES", "translate_error"]
