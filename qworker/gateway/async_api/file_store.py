"""The bytes of /v1/files behind a small seam: a local directory for one replica, or S3
(`s3://bucket/prefix?endpoint_url=...`) for several. Metadata (owner, name, purpose, expiry) is
a record (records.py); here are only the bytes, by file id.

Writes stream: an upload is written as it arrives, and is visible under its id only once
committed (a local file renamed into place; an S3 multipart upload completed), so a refused or
cut upload leaves nothing stored. Batch runs read a file through `location()`, as `qworker batch`
reads its input, and a batch's output is published with `put_path()`.
"""

from __future__ import annotations

import abc
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from qworker.openai.batches.files import Location, parse_location

# Bytes per read of a stored file.
READ_CHUNK_BYTES = 1 << 20
# S3 multipart parts: every part but the last must be at least 5 MiB.
S3_PART_BYTES = 8 << 20


class FileWriter(abc.ABC):
    @abc.abstractmethod
    def write(self, chunk: bytes) -> None: ...

    @abc.abstractmethod
    def commit(self) -> None:
        """Make the bytes visible under the file's id."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Drop everything written; nothing is stored."""


class FileStore(abc.ABC):
    @abc.abstractmethod
    def writer(self, file_id: str) -> FileWriter: ...

    @abc.abstractmethod
    def read(self, file_id: str) -> Iterator[bytes]:
        """The file's bytes in chunks."""

    @abc.abstractmethod
    def location(self, file_id: str) -> Location:
        """Where `qworker batch`'s readers find the file."""

    @abc.abstractmethod
    def put_path(self, file_id: str, path: Path) -> None:
        """Store the local file `path` under `file_id`."""

    @abc.abstractmethod
    def delete(self, file_id: str) -> None: ...


class _LocalWriter(FileWriter):
    def __init__(self, target: Path) -> None:
        self.target = target
        self.partial = target.with_name(f"{target.name}.{uuid.uuid4().hex}.partial")
        self._file = open(self.partial, "wb")  # noqa: SIM115 - closed in commit/abort

    def write(self, chunk: bytes) -> None:
        self._file.write(chunk)

    def commit(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self.partial, self.target)

    def abort(self) -> None:
        self._file.close()
        self.partial.unlink(missing_ok=True)


class LocalFileStore(FileStore):
    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def path(self, file_id: str) -> Path:
        assert "/" not in file_id and not file_id.startswith("."), f"not a file id: {file_id!r}"
        return self.root / f"{file_id}.jsonl"

    def writer(self, file_id: str) -> FileWriter:
        return _LocalWriter(self.path(file_id))

    def read(self, file_id: str) -> Iterator[bytes]:
        with open(self.path(file_id), "rb") as f:
            while chunk := f.read(READ_CHUNK_BYTES):
                yield chunk

    def location(self, file_id: str) -> Location:
        return parse_location(str(self.path(file_id)))

    def put_path(self, file_id: str, path: Path) -> None:
        partial = self.path(file_id).with_suffix(".partial")
        shutil.copyfile(path, partial)
        os.replace(partial, self.path(file_id))

    def delete(self, file_id: str) -> None:
        self.path(file_id).unlink(missing_ok=True)


class _S3Writer(FileWriter):
    """A multipart upload, started once the first part is full (a small file is one PutObject)."""

    def __init__(self, s3: Any, bucket: str, key: str) -> None:
        self.s3, self.bucket, self.key = s3, bucket, key
        self._buffer = bytearray()
        self._upload_id: str | None = None
        self._parts: list[dict[str, Any]] = []

    def _flush_part(self) -> None:
        if self._upload_id is None:
            reply = self.s3.create_multipart_upload(Bucket=self.bucket, Key=self.key)
            self._upload_id = reply["UploadId"]
        number = len(self._parts) + 1
        reply = self.s3.upload_part(
            Bucket=self.bucket,
            Key=self.key,
            UploadId=self._upload_id,
            PartNumber=number,
            Body=bytes(self._buffer),
        )
        self._parts.append({"ETag": reply["ETag"], "PartNumber": number})
        self._buffer.clear()

    def write(self, chunk: bytes) -> None:
        self._buffer += chunk
        if len(self._buffer) >= S3_PART_BYTES:
            self._flush_part()

    def commit(self) -> None:
        if self._upload_id is None:
            self.s3.put_object(Bucket=self.bucket, Key=self.key, Body=bytes(self._buffer))
            return
        if self._buffer:
            self._flush_part()
        self.s3.complete_multipart_upload(
            Bucket=self.bucket, Key=self.key, UploadId=self._upload_id, MultipartUpload={"Parts": self._parts}
        )

    def abort(self) -> None:
        self._buffer.clear()
        if self._upload_id is not None:
            self.s3.abort_multipart_upload(Bucket=self.bucket, Key=self.key, UploadId=self._upload_id)


class S3FileStore(FileStore):
    def __init__(self, url: str) -> None:
        from qworker.backends.aws import aws_client, aws_parts

        self.url = url
        self.bucket, path, self.params = aws_parts(url)
        self.prefix = path.strip("/")
        self.s3 = aws_client("s3", self.params)

    def key(self, file_id: str) -> str:
        return f"{self.prefix}/{file_id}.jsonl" if self.prefix else f"{file_id}.jsonl"

    def writer(self, file_id: str) -> FileWriter:
        return _S3Writer(self.s3, self.bucket, self.key(file_id))

    def read(self, file_id: str) -> Iterator[bytes]:
        body = self.s3.get_object(Bucket=self.bucket, Key=self.key(file_id))["Body"]
        try:
            yield from body.iter_chunks(READ_CHUNK_BYTES)
        finally:
            body.close()

    def location(self, file_id: str) -> Location:
        query = "&".join(f"{name}={value}" for name, value in self.params.items())
        return parse_location(f"s3://{self.bucket}/{self.key(file_id)}" + (f"?{query}" if query else ""))

    def put_path(self, file_id: str, path: Path) -> None:
        self.s3.upload_file(str(path), self.bucket, self.key(file_id))

    def delete(self, file_id: str) -> None:
        self.s3.delete_object(Bucket=self.bucket, Key=self.key(file_id))


def open_file_store(url: str) -> FileStore:
    """`s3://bucket/prefix?...` or a local directory (a path or `file:///path`)."""
    if url.startswith("s3://"):
        return S3FileStore(url)
    return LocalFileStore(Path(url.removeprefix("file://")))
