"""AWS URLs and clients, shared by the SQS queue (sqs/) and the S3 result store (s3/).

    sqs://QUEUE?region=...&endpoint_url=...&dead_letter=...&lease_timeout_s=...&payload_s3=s3://b/p
    s3://bucket/prefix?region=...&endpoint_url=...&conditional_put=true

Credentials come from boto3's standard chain (environment, profile, instance role).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from qworker.backends import Requirement
from qworker.backends.urls import InvalidURLError, query_params, redact_url, reject_unknown_params, url_number
from qworker.errors import MissingDependencyError

AWS_PARAMS = {
    "region",
    "endpoint_url",
    "dead_letter",
    "lease_timeout_s",
    "payload_s3",
    "conditional_put",
    "retry_mode",
    "max_attempts",
}
# botocore's retry modes: "standard" retries throttling (ThrottlingException, SlowDown, ...),
# 5xx and connection errors with exponential backoff and jitter (at most 20 s between attempts)
# under a client-side retry quota; "adaptive" adds a client-side rate limiter that slows down
# while the service throttles. max_attempts counts the first call: 8 calls span at most about
# a minute of backoff before the error reaches the worker.
AWS_RETRY_MODES = ("standard", "adaptive")
AWS_DEFAULT_RETRY_MODE = "standard"
AWS_DEFAULT_MAX_ATTEMPTS = 8
# Above this, a call could retry for many minutes while the worker holds leases it cannot extend.
AWS_MAX_MAX_ATTEMPTS = 20


def aws_parts(url: str) -> tuple[str, str, dict[str, str]]:
    """(netloc, path, params) of an sqs:// or s3:// URL; unknown parameters are an error."""
    query = query_params(url)
    reject_unknown_params(url, query, AWS_PARAMS)
    parts = urlsplit(url)
    if not parts.netloc:
        raise InvalidURLError(f"URL {redact_url(url)!r} names no queue or bucket")
    return parts.netloc, parts.path, query


def require_boto3(what: str) -> None:
    """Raise MissingDependencyError, naming the extra, when boto3 is not installed."""
    if not Requirement("boto3", "aws").is_installed():
        raise MissingDependencyError(f"{what} needs the boto3 package: pip install 'qworker[aws]'")


def aws_client(service: str, params: dict[str, str]) -> Any:  # a boto3 client
    """A boto3 client. Credentials come from boto3's standard chain (environment, profile, instance
    role); the region, endpoint and retry policy (retry_mode, max_attempts) come from the URL."""
    require_boto3(f"an {service} URL")
    import boto3
    from botocore.config import Config

    return boto3.session.Session().client(
        service,
        region_name=params.get("region") or None,
        endpoint_url=params.get("endpoint_url") or None,
        config=Config(retries=aws_retries(params)),
    )


def aws_retries(params: dict[str, str]) -> dict[str, Any]:
    """botocore's `retries` config from the URL's retry_mode and max_attempts."""
    mode = params.get("retry_mode") or AWS_DEFAULT_RETRY_MODE
    if mode not in AWS_RETRY_MODES:
        raise InvalidURLError(f"URL parameter retry_mode={mode!r}: use {' or '.join(AWS_RETRY_MODES)}")
    attempts = url_number(params, "max_attempts", AWS_DEFAULT_MAX_ATTEMPTS)
    if attempts != int(attempts) or not 1 <= attempts <= AWS_MAX_MAX_ATTEMPTS:
        raise InvalidURLError(
            f"URL parameter max_attempts={params['max_attempts']!r}: "
            f"a whole number from 1 to {AWS_MAX_MAX_ATTEMPTS}"
        )
    return {"mode": mode, "total_max_attempts": int(attempts)}


def s3_location_of_results(url: str) -> str | None:
    """Where a client puts large job payloads by default: under the results prefix of an s3:// URL."""
    if not url.startswith("s3://"):
        return None
    bucket, path, _ = aws_parts(url)
    prefix = path.strip("/")
    return f"s3://{bucket}/{prefix + '/' if prefix else ''}_payloads"
