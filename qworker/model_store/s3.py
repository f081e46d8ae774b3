"""A Hugging Face directory under an S3 prefix, downloaded once into the local cache.

`s3://bucket/prefix/?endpoint_url=...&region=...` names the objects directly under the prefix
(config.json, tokenizer files, *.safetensors shards and their index). Rules:

- Downloaded once: the cache directory is complete only when its marker file
  (`.qworker-complete.json`) is there, and the marker is written last. A directory without it is
  never handed to the loader, so a half-downloaded model is never loaded.
- Concurrent (up to MAX_CONCURRENT_FILES objects at a time), with progress in the log.
- Verified: each object's size, and its ETag recomputed from the bytes (MD5, or MD5 of the part
  MD5s for multipart uploads) where the ETag is one (SSE-KMS and SSE-C ETags are not: those are
  checked by size only); every safetensors file must be as long as its header describes.
- Resumable: bytes go to `.partial/<name>` and continue from its length after a kill (a ranged
  GET with If-Match on the ETag the partial was started with, so a replaced object starts over).
  A file is renamed to its final name only once verified.
- Safe for several processes on one node: a file lock beside the cache directory; the second
  process waits for the first and then reuses its download.
- Credentials come from boto3's standard chain (environment, shared files, container or instance
  role); the URL's `endpoint_url` and `region` parameters go to the client, as for the other
  s3:// URLs qworker takes.

A complete cache directory is trusted without asking S3 again (a warm start needs no network):
publish a new model version under a new prefix rather than overwriting one in place.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from qworker.errors import ConnectError, MissingDependencyError, ModelDownloadError, UnknownModelError
from qworker.model_store.verify import ETagHasher, check_safetensors_length, etag_part_count, is_md5_etag

logger = logging.getLogger(__name__)

URL_PARAMS = ("endpoint_url", "region")
MAX_CONCURRENT_FILES = 8
CHUNK_BYTES = 2**20
PROGRESS_INTERVAL_S = 2.0
# Attempts per object when the connection drops mid-body (each continues from the partial file).
MAX_STREAM_ATTEMPTS = 3
COMPLETE_MARKER = ".qworker-complete.json"
PARTIAL_DIR = ".partial"
# Weights in formats the loader never reads from a Hugging Face directory (it reads safetensors).
SKIPPED_SUFFIXES = (".bin", ".pth", ".pt", ".ckpt", ".h5", ".msgpack", ".onnx", ".gguf")
AWS_CREDENTIAL_SOURCES = (
    "boto3 looked in the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY), the shared files "
    "(~/.aws/credentials, ~/.aws/config, AWS_PROFILE) and the container or instance role"
)


@dataclass(frozen=True)
class S3ModelURL:
    bucket: str
    prefix: str  # "" or ending in "/"
    endpoint_url: str | None
    region: str | None

    @classmethod
    def parse(cls, url: str) -> S3ModelURL:
        parts = urlsplit(url)
        if parts.scheme != "s3" or not parts.netloc:
            raise UnknownModelError(f"model URL {url!r}: expected s3://bucket/prefix/")
        params = dict(parse_qsl(parts.query, keep_blank_values=True))
        unknown = sorted(set(params) - set(URL_PARAMS))
        if unknown:
            raise UnknownModelError(
                f"model URL {url!r}: unknown URL parameter {unknown[0]!r}. Accepted: {', '.join(URL_PARAMS)}"
            )
        prefix = parts.path.lstrip("/")
        if prefix and not prefix.endswith("/"):
            prefix += "/"
        return cls(parts.netloc, prefix, params.get("endpoint_url") or None, params.get("region") or None)

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"

    def cache_name(self) -> str:
        """A directory name: readable, and distinct for every endpoint, bucket and prefix."""
        key = hashlib.sha256(f"{self.endpoint_url}|{self.bucket}|{self.prefix}".encode()).hexdigest()[:12]
        readable = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{self.bucket}_{self.prefix}".strip("/"))[:80]
        return f"{readable}-{key}"


@dataclass(frozen=True)
class RemoteObject:
    key: str
    name: str  # the file name in the model directory
    size: int
    etag: str  # without quotes


def is_complete(target: Path) -> bool:
    """Whether `target` holds a finished download: its marker, and every file it lists at its size."""
    try:
        marker = json.loads((target / COMPLETE_MARKER).read_text())
        return all((target / o["name"]).stat().st_size == o["size"] for o in marker["objects"])
    except (OSError, ValueError, KeyError, TypeError):
        return False


def download_s3_model(url: str, models_dir: Path, config_name: str = "config.json") -> Path:
    """The cache directory holding the complete model at `url` (see the module docstring).
    `config_name` is the file a complete directory must hold: a LoRA adapter's is
    adapter_config.json."""
    from filelock import FileLock, Timeout

    location = S3ModelURL.parse(url)
    target = models_dir / "s3" / location.cache_name()
    if is_complete(target):
        logger.info("model %s: in the cache at %s", location, target)
        return target
    target.mkdir(parents=True, exist_ok=True)
    lock = FileLock(f"{target}.lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        logger.info("model %s: another process is downloading it into %s; waiting for it", location, target)
        lock.acquire()
    try:
        if is_complete(target):
            logger.info("model %s: downloaded by another process, reusing %s", location, target)
            return target
        _Download(location, target, config_name).run()
    finally:
        lock.release()
    return target


@contextmanager
def store_errors(location: S3ModelURL) -> Iterator[None]:
    """botocore's failures to reach S3 or to be let in, as one-line ConnectErrors naming the model."""
    import botocore.exceptions as boto

    where = f"cannot download the model {location}"
    try:
        yield
    except (boto.NoCredentialsError, boto.PartialCredentialsError) as exc:
        raise ConnectError(f"{where}: no AWS credentials found: {AWS_CREDENTIAL_SOURCES}") from exc
    except (boto.EndpointConnectionError, boto.ConnectTimeoutError, boto.ProfileNotFound) as exc:
        raise ConnectError(f"{where}: {exc}") from exc
    except boto.ClientError as exc:
        error = exc.response.get("Error", {})
        raise ConnectError(
            f"{where}: the service answered {error.get('Code', '?')}: {error.get('Message', exc)}"
        ) from exc


class _Progress:
    """Bytes done across the concurrent downloads, logged at most every PROGRESS_INTERVAL_S."""

    def __init__(self, location: S3ModelURL, total_bytes: int, total_files: int) -> None:
        self.location = location
        self.total_bytes = total_bytes
        self.total_files = total_files
        self.done_bytes = 0
        self.done_files = 0
        self.fetched_bytes = 0  # excluding what was already there before this start
        self.started = time.monotonic()
        self._last_log = self.started
        self._lock = threading.Lock()

    def add(self, num_bytes: int, *, fetched: bool) -> None:
        with self._lock:
            self.done_bytes += num_bytes
            self.fetched_bytes += num_bytes if fetched else 0
            now = time.monotonic()
            if now - self._last_log >= PROGRESS_INTERVAL_S:
                self._last_log = now
                self._log(now)

    def file_done(self) -> None:
        with self._lock:
            self.done_files += 1

    def _log(self, now: float) -> None:
        rate = self.fetched_bytes / max(now - self.started, 1e-9)
        logger.info(
            "model %s: %.1f of %.1f MB (%.0f%%), %d of %d files, %.1f MB/s",
            self.location,
            self.done_bytes / 1e6,
            self.total_bytes / 1e6,
            100 * self.done_bytes / max(self.total_bytes, 1),
            self.done_files,
            self.total_files,
            rate / 1e6,
        )


class _Download:
    """One download of a model directory into `target`, under the caller's lock."""

    def __init__(self, location: S3ModelURL, target: Path, config_name: str = "config.json") -> None:
        self.location = location
        self.target = target
        self.config_name = config_name
        self.partial_dir = target / PARTIAL_DIR
        self._stop = threading.Event()
        self.client: Any = None

    def run(self) -> None:
        try:
            import boto3
        except ImportError:
            raise MissingDependencyError(
                "an s3:// model needs the boto3 package: pip install 'qworker[aws]'"
            ) from None
        from botocore.config import Config

        self.client = boto3.session.Session().client(
            "s3",
            region_name=self.location.region,
            endpoint_url=self.location.endpoint_url,
            config=Config(
                retries={"mode": "standard", "total_max_attempts": 5},
                max_pool_connections=2 * MAX_CONCURRENT_FILES,
            ),
        )
        with store_errors(self.location):
            objects = self._list()
            self.partial_dir.mkdir(exist_ok=True)
            progress = _Progress(self.location, sum(o.size for o in objects), len(objects))
            logger.info(
                "model %s: downloading %d files, %.1f MB, into %s",
                self.location,
                len(objects),
                progress.total_bytes / 1e6,
                self.target,
            )
            with ThreadPoolExecutor(max_workers=min(MAX_CONCURRENT_FILES, len(objects))) as pool:
                futures = [pool.submit(self._fetch, obj, progress) for obj in objects]
                wait(futures, return_when=FIRST_EXCEPTION)
                # One failure stops the other transfers (their partial files stay for a restart).
                self._stop.set()
            failures = [exc for f in futures if (exc := f.exception()) is not None]
            causes = [exc for exc in failures if not isinstance(exc, _Stopped)]
            if failures:
                raise (causes or failures)[0]
        elapsed = time.monotonic() - progress.started
        marker = {
            "url": str(self.location),
            "endpoint_url": self.location.endpoint_url,
            "completed_unix": time.time(),
            "objects": [asdict(o) for o in objects],
        }
        tmp = self.target / f"{COMPLETE_MARKER}.tmp"
        tmp.write_text(json.dumps(marker, indent=1))
        os.replace(tmp, self.target / COMPLETE_MARKER)
        logger.info(
            "model %s: complete, %.1f MB fetched in %.1fs (%.1f MB already there)",
            self.location,
            progress.fetched_bytes / 1e6,
            elapsed,
            (progress.done_bytes - progress.fetched_bytes) / 1e6,
        )

    def _list(self) -> list[RemoteObject]:
        objects, skipped = [], []
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.location.bucket, Prefix=self.location.prefix, Delimiter="/"
        )
        for page in pages:
            for item in page.get("Contents") or []:
                name = item["Key"][len(self.location.prefix) :]
                if not name or name.startswith(".") or "/" in name:
                    continue
                if name.endswith(SKIPPED_SUFFIXES):
                    skipped.append(name)
                    continue
                objects.append(RemoteObject(item["Key"], name, int(item["Size"]), item["ETag"].strip('"')))
        if skipped:
            logger.info(
                "model %s: not downloading %s (only safetensors weights are read)", self.location, skipped
            )
        if not any(o.name == self.config_name for o in objects):
            raise ModelDownloadError(
                f"model {self.location}: no {self.config_name} directly under the prefix; expected a "
                f"Hugging Face directory (found {len(objects)} other objects)"
            )
        if not any(o.name.endswith(".safetensors") for o in objects):
            raise ModelDownloadError(f"model {self.location}: no *.safetensors weights under the prefix")
        return sorted(objects, key=lambda o: -o.size)  # the largest first: the longest transfers

    def _fetch(self, obj: RemoteObject, progress: _Progress) -> None:
        final = self.target / obj.name
        done_etag = self.partial_dir / f"{obj.name}.done"
        if final.is_file() and final.stat().st_size == obj.size and _read(done_etag) == obj.etag:
            progress.add(obj.size, fetched=False)
            progress.file_done()
            return
        partial = self.partial_dir / obj.name
        started_etag = self.partial_dir / f"{obj.name}.etag"
        offset = partial.stat().st_size if partial.is_file() else 0
        if _read(started_etag) != obj.etag or offset > obj.size:
            offset = 0
            partial.write_bytes(b"")
            started_etag.write_text(obj.etag)
        elif offset:
            logger.info(
                "model %s: %s continues at %.1f of %.1f MB",
                self.location,
                obj.name,
                offset / 1e6,
                obj.size / 1e6,
            )
        hasher = self._hasher(obj)
        if hasher is not None and offset:
            hasher.update_from_file(partial, offset)
        progress.add(offset, fetched=False)
        for attempt in range(1, MAX_STREAM_ATTEMPTS + 1):
            try:
                offset = self._stream(obj, partial, offset, hasher, progress)
                break
            except _stream_errors() as exc:
                if attempt == MAX_STREAM_ATTEMPTS:
                    raise ConnectError(
                        f"cannot download the model {self.location}: {obj.name}: {exc}"
                    ) from exc
                logger.warning(
                    "model %s: %s interrupted at %d bytes (%s); continuing",
                    self.location,
                    obj.name,
                    offset,
                    exc,
                )
                offset = partial.stat().st_size
        self._verify(obj, partial, hasher)
        os.replace(partial, final)
        done_etag.write_text(obj.etag)
        started_etag.unlink(missing_ok=True)
        progress.file_done()

    def _hasher(self, obj: RemoteObject) -> ETagHasher | None:
        """What recomputes this object's ETag; None where the ETag is not an MD5 of the bytes."""
        if not is_md5_etag(obj.etag):
            return None
        head = self.client.head_object(Bucket=self.location.bucket, Key=obj.key)
        if str(head.get("ServerSideEncryption", "")).startswith("aws:kms") or head.get(
            "SSECustomerAlgorithm"
        ):
            return None  # an SSE-KMS or SSE-C ETag is not the MD5 of the bytes: size only
        if etag_part_count(obj.etag) is None:
            return ETagHasher(part_size=None)
        first_part = self.client.head_object(Bucket=self.location.bucket, Key=obj.key, PartNumber=1)
        return ETagHasher(part_size=int(first_part["ContentLength"]))

    def _stream(
        self, obj: RemoteObject, partial: Path, offset: int, hasher: ETagHasher | None, progress: _Progress
    ) -> int:
        """Append the object's bytes from `offset` to `partial`; the new length."""
        if offset >= obj.size:
            return offset
        response = self.client.get_object(
            Bucket=self.location.bucket, Key=obj.key, Range=f"bytes={offset}-", IfMatch=f'"{obj.etag}"'
        )
        with partial.open("ab") as f:
            for chunk in response["Body"].iter_chunks(CHUNK_BYTES):
                if self._stop.is_set():
                    raise _Stopped(obj.name)
                f.write(chunk)
                offset += len(chunk)
                if hasher is not None:
                    hasher.update(chunk)
                progress.add(len(chunk), fetched=True)
        return offset

    def _verify(self, obj: RemoteObject, partial: Path, hasher: ETagHasher | None) -> None:
        size = partial.stat().st_size
        problem = None
        if size != obj.size:
            problem = f"{size} bytes received, the store lists {obj.size}"
        elif hasher is not None and hasher.hexdigest() != obj.etag:
            problem = f"the bytes' ETag is {hasher.hexdigest()}, the store's is {obj.etag}"
        if problem is None and obj.name.endswith(".safetensors"):
            try:
                check_safetensors_length(partial, obj.name)
            except ModelDownloadError as exc:
                problem = str(exc)
        if problem is not None:
            partial.unlink(missing_ok=True)
            raise ModelDownloadError(f"model {self.location}: {obj.name} refused: {problem}")


class _Stopped(Exception):
    """A transfer stopped because another one failed."""


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _stream_errors() -> tuple[type[Exception], ...]:
    """botocore's errors for a connection that drops while a body streams."""
    import botocore.exceptions as boto

    return (boto.ResponseStreamingError, boto.ReadTimeoutError, boto.ConnectionClosedError)
