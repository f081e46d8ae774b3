"""Checks that a downloaded object is the one the store holds: its S3 ETag recomputed from the
bytes, and for safetensors files, a length that matches what their header describes."""

from __future__ import annotations

import hashlib
import json
import re
import struct
from pathlib import Path

from qworker.errors import ModelDownloadError

# An ETag of a single-part upload without SSE-KMS/SSE-C is the MD5 of the object; one of a
# multipart upload is the MD5 of the parts' MD5 digests, then "-<number of parts>".
_SINGLE_PART_ETAG = re.compile(r"[0-9a-f]{32}")
_MULTIPART_ETAG = re.compile(r"[0-9a-f]{32}-(\d+)")

SAFETENSORS_HEADER_LIMIT = 100 * 2**20  # safetensors itself refuses headers above 100 MB


def etag_part_count(etag: str) -> int | None:
    """The number of parts a multipart ETag names; None for a single-part ETag."""
    match = _MULTIPART_ETAG.fullmatch(etag)
    return int(match.group(1)) if match else None


def is_md5_etag(etag: str) -> bool:
    """Whether `etag` (unquoted) has a shape that MD5 digests of the bytes can reproduce."""
    return bool(_SINGLE_PART_ETAG.fullmatch(etag) or _MULTIPART_ETAG.fullmatch(etag))


class ETagHasher:
    """Recomputes an S3 ETag from the bytes fed to it in order. `part_size` is the size of every
    part but the last (multipart uploads); None for a single-part object."""

    def __init__(self, part_size: int | None) -> None:
        assert part_size is None or part_size > 0, f"part size must be positive, got {part_size}"
        self.part_size = part_size
        self._part = hashlib.md5(usedforsecurity=False)
        self._part_bytes = 0
        self._digests: list[bytes] = []

    def update(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        while view:
            take = len(view) if self.part_size is None else min(len(view), self.part_size - self._part_bytes)
            self._part.update(view[:take])
            self._part_bytes += take
            view = view[take:]
            if self.part_size is not None and self._part_bytes == self.part_size:
                self._digests.append(self._part.digest())
                self._part = hashlib.md5(usedforsecurity=False)
                self._part_bytes = 0

    def hexdigest(self) -> str:
        if self.part_size is None:
            return self._part.hexdigest()
        digests = self._digests + ([self._part.digest()] if self._part_bytes else [])
        return f"{hashlib.md5(b''.join(digests), usedforsecurity=False).hexdigest()}-{len(digests)}"

    def update_from_file(self, path: Path, num_bytes: int, chunk_bytes: int = 8 * 2**20) -> None:
        """Feed the first `num_bytes` of `path` (the part of a download done before a restart)."""
        with path.open("rb") as f:
            left = num_bytes
            while left:
                chunk = f.read(min(chunk_bytes, left))
                assert chunk, f"{path} is shorter than {num_bytes} bytes"
                self.update(chunk)
                left -= len(chunk)


def check_safetensors_length(path: Path, name: str) -> None:
    """Raises ModelDownloadError unless `path` is exactly as long as its safetensors header says:
    8 bytes of header length, the JSON header, then the tensors up to their last data offset."""
    size = path.stat().st_size
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ModelDownloadError(f"{name} is {size} bytes: too short for a safetensors file")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > min(SAFETENSORS_HEADER_LIMIT, size - 8):
            raise ModelDownloadError(
                f"{name} is {size} bytes but its safetensors header claims {header_len} bytes: "
                "the object is truncated or not a safetensors file"
            )
        try:
            header = json.loads(f.read(header_len))
            end = max(
                (int(entry["data_offsets"][1]) for key, entry in header.items() if key != "__metadata__"),
                default=0,
            )
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            raise ModelDownloadError(f"{name}: unreadable safetensors header ({exc})") from exc
    expected = 8 + header_len + end
    if size != expected:
        raise ModelDownloadError(
            f"{name} is {size} bytes but its safetensors header describes {expected}: "
            "the object in the store is truncated or corrupt"
        )
