"""botocore's failures on S3 calls, read as ../aws_errors.py reads every AWS client's (NoSuchBucket
among them). A missing object is no failure: the result store reads it as "no result yet" before
an error gets this far."""

from __future__ import annotations

from qworker.backends.aws_errors import LIBRARIES, translate_error

__all__ = ["LIBRARIES", "translate_error"]
