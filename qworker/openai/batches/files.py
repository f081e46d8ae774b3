"""Where batch files live: a local path or an S3 object, `s3://bucket/key?endpoint_url=...&region=...`
(the URL parameters of qworker's S3 result store; credentials from boto3's standard chain).

Reads stream: the input is read line by line, an S3 object in chunks, so that a file of a
million rows never sits in memory. Writes go to a local file; an S3 output is a local staging
file uploaded when the batch is done (S3 objects cannot be appended to).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qworker import envs
from qworker.errors import QworkerError
from qworker.openai.format import BatchInputLine

# Bytes per read of an S3 object.
S3_CHUNK_BYTES = 1 << 20


class BatchLocationError(QworkerError, ValueError):
    """An input or output location qworker cannot use."""


@dataclass(frozen=True)
class Location:
    """A local file (`path`) or an S3 object (`bucket`, `key`, URL `params`)."""

    text: str
    path: Path | None = None
    bucket: str | None = None
    key: str | None = None
    params: dict[str, str] = field(default_factory=dict, compare=False)

    @property
    def is_s3(self) -> bool:
        return self.bucket is not None

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.key}" if self.is_s3 else str(self.path)


def parse_location(text: str) -> Location:
    """`text` as a Location: `s3://bucket/key[?params]`, `file:///path`, or a plain path."""
    if text.startswith("s3://"):
        from qworker.backends.connections import aws_parts

        bucket, path, params = aws_parts(text)
        key = path.lstrip("/")
        if not key:
            raise BatchLocationError(f"{text!r} names a bucket but no object key: s3://bucket/key")
        return Location(text, bucket=bucket, key=key, params=params)
    if text.startswith("file://"):
        return Location(text, path=Path(text.removeprefix("file://")))
    if "://" in text:
        raise BatchLocationError(f"{text!r}: use a local path or s3://bucket/key")
    return Location(text, path=Path(text))


def s3_client(location: Location) -> Any:  # a boto3 S3 client
    from qworker.backends.connections import aws_client

    return aws_client("s3", location.params)


def _is_missing(exc: Exception) -> bool:
    response = getattr(exc, "response", None) or {}
    code = str(response.get("Error", {}).get("Code", ""))
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return status == 404 or code in ("404", "NoSuchKey", "NotFound")


def split_lines(chunks: Iterable[bytes]) -> Iterator[bytes]:
    """Lines (without their newline) of a byte stream that arrives in chunks."""
    pending: list[bytes] = []
    for chunk in chunks:
        start = 0
        while True:
            end = chunk.find(b"\n", start)
            if end == -1:
                if start < len(chunk):
                    pending.append(chunk[start:])
                break
            pending.append(chunk[start:end])
            yield b"".join(pending)
            pending = []
            start = end + 1
    if pending:
        yield b"".join(pending)


def read_lines(location: Location) -> Iterator[bytes]:
    """The file's lines without their newlines, streamed. A missing file is a BatchLocationError."""
    if not location.is_s3:
        assert location.path is not None, "a local location has a path"
        try:
            f = open(location.path, "rb")  # noqa: SIM115 - closed by the with below, in the generator
        except OSError as exc:
            raise BatchLocationError(f"cannot read {location.path}: {exc.strerror}") from None
        with f:
            for line in f:
                yield line.removesuffix(b"\n")
        return
    from botocore.exceptions import ClientError

    client = s3_client(location)
    try:
        reply = client.get_object(Bucket=location.bucket, Key=location.key)
    except ClientError as exc:
        if _is_missing(exc):
            raise BatchLocationError(f"{location} does not exist") from None
        raise
    try:
        yield from split_lines(reply["Body"].iter_chunks(S3_CHUNK_BYTES))
    finally:
        reply["Body"].close()
        client.close()


def download(location: Location, target: Path) -> bool:
    """Copy an S3 object to `target`; False (and nothing written) when the object does not exist."""
    from botocore.exceptions import ClientError

    client = s3_client(location)
    try:
        try:
            client.head_object(Bucket=location.bucket, Key=location.key)
        except ClientError as exc:
            if _is_missing(exc):
                return False
            raise
        partial = target.with_name(target.name + ".download")
        client.download_file(location.bucket, location.key, str(partial))
        os.replace(partial, target)
        return True
    finally:
        client.close()


def upload(source: Path, location: Location) -> None:
    """Put the local file `source` at the S3 location (multipart for large files)."""
    client = s3_client(location)
    try:
        client.upload_file(
            str(source), location.bucket, location.key, ExtraArgs={"ContentType": "application/jsonl"}
        )
    finally:
        client.close()


def cache_dir() -> Path:
    """qworker's cache folder (as for converted models): $QWORKER_CACHE_DIR or ~/.cache/qworker."""
    return envs.cache_dir()


@dataclass(frozen=True)
class InputRow:
    """One non-blank input line, parsed. The whole-file check has run: custom_id and method are fine."""

    line_no: int
    custom_id: str
    url: Any
    body: Any


def iter_rows(location: Location) -> Iterator[InputRow]:
    """The input's rows, streamed, blank lines skipped (as vLLM's run-batch does)."""
    for line_no, raw in enumerate(read_lines(location), 1):
        if not raw.strip():
            continue
        # json.loads, as the check used: pydantic's own JSON parser differs on NaN and the like.
        line = BatchInputLine.model_validate(json.loads(raw))
        yield InputRow(line_no, line.custom_id, line.url, line.body)
