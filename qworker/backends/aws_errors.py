"""botocore's failures as qworker reads them, shared by the SQS (sqs/errors.py) and S3
(s3/errors.py) backends.

A call reaches the worker only after botocore's own retries (the URL's retry_mode and
max_attempts) gave up, so the worker's outage clock starts where botocore's stops:
- transient: the endpoint unreachable or the connection cut or timed out (botocore's
  ConnectionError and HTTPClientError families: EndpointConnectionError, ConnectTimeoutError,
  ConnectionClosedError, ReadTimeoutError, ...), throttling, 5xx;
- configuration: no credentials, a missing profile, an identity the service refuses or does not
  know, no permission, a queue or bucket that does not exist;
- any other service answer is a plain BrokerError (neither retried nor blamed on settings).
"""

from __future__ import annotations

from qworker.errors import BrokerConfigurationError, BrokerError, TransientBrokerError

LIBRARIES = ("botocore",)

AWS_CREDENTIAL_SOURCES = (
    "boto3 looked in the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY), the shared files "
    "(~/.aws/credentials, ~/.aws/config, AWS_PROFILE) and the container or instance role"
)

# The codes botocore's standard retry mode retries (botocore/retries/standard.py:
# TransientRetryableChecker and ThrottledRetryableChecker), and the statuses.
TRANSIENT_CODES = frozenset(
    {
        "RequestTimeout",
        "RequestTimeoutException",
        "PriorRequestNotComplete",
        "InternalError",
        "InternalFailure",
        "ServiceUnavailable",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottledException",
        "TooManyRequestsException",
        "ProvisionedThroughputExceededException",
        "TransactionInProgressException",
        "RequestLimitExceeded",
        "BandwidthLimitExceeded",
        "LimitExceededException",
        "RequestThrottled",
        "SlowDown",
        "EC2ThrottledException",
    }
)
TRANSIENT_STATUSES = frozenset({429, 500, 502, 503, 504})
# Any AWS service: the caller's identity or its rights.
CONFIGURATION_CODES = frozenset(
    {
        "AccessDenied",
        "AccessDeniedException",
        "InvalidAccessKeyId",
        "InvalidClientTokenId",
        "UnrecognizedClientException",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "ExpiredTokenException",
        "InvalidToken",
        "AuthFailure",
        # A store that does not exist: SQS's JSON and query protocols' codes, S3's. One set
        # serves both backends, since each code comes from its own service only (and the shared
        # walk in ../errors.py asks whichever botocore backend comes first in the table).
        "QueueDoesNotExist",
        "AWS.SimpleQueueService.NonExistentQueue",
        "NoSuchBucket",
    }
)


def translate_error(exc: BaseException) -> BrokerError | None:
    """The reading of a botocore exception (None: not one)."""
    import botocore.exceptions as boto  # type: ignore[import-untyped]

    if isinstance(exc, boto.NoCredentialsError | boto.PartialCredentialsError):
        return BrokerConfigurationError(f"no AWS credentials found: {AWS_CREDENTIAL_SOURCES}")
    if isinstance(exc, boto.ProfileNotFound):
        return BrokerConfigurationError(str(exc))
    if isinstance(exc, boto.ConnectionError | boto.HTTPClientError | boto.IncompleteReadError):
        return TransientBrokerError(str(exc))
    if isinstance(exc, boto.ClientError):
        error = exc.response.get("Error", {})
        code = str(error.get("Code", "?"))
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
        answer = f"the service answered {code}: {error.get('Message', exc)}"
        if code in TRANSIENT_CODES or status in TRANSIENT_STATUSES:
            return TransientBrokerError(answer)
        if code in CONFIGURATION_CODES or status == 403:
            return BrokerConfigurationError(answer)
        return BrokerError(answer)
    return None
