"""A `multipart/form-data` upload (POST /v1/files) parsed as it arrives: the `file` part goes
straight to a FileWriter while its bytes and lines are counted, so the limits (bytes and rows)
are enforced while streaming, and an upload over either is refused (413) and aborted before
anything is stored. The whole body is never held: only the small form fields (`purpose`, ...)
are kept, each capped.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import anyio.to_thread
from python_multipart.multipart import MultipartParser, parse_options_header

from qworker.gateway.async_api.file_store import FileWriter
from qworker.gateway.errors import GatewayError

# A form field other than the file (purpose, expires_after[...]) is a short text.
MAX_FIELD_BYTES = 1024
MAX_FIELDS = 16


@dataclass
class UploadLimits:
    max_bytes: int
    max_rows: int


@dataclass
class Upload:
    """What arrived: the form's text fields, and the file's name, size and line count."""

    fields: dict[str, str] = field(default_factory=dict)
    filename: str | None = None
    num_bytes: int = 0
    num_rows: int = 0


class _Part:
    def __init__(self) -> None:
        self.header_field = bytearray()
        self.header_value = bytearray()
        self.headers: dict[str, bytes] = {}
        self.name: str | None = None
        self.filename: str | None = None
        self.value = bytearray()


async def receive_upload(
    body: AsyncIterator[bytes], content_type: str | None, writer: FileWriter, limits: UploadLimits
) -> Upload:
    """Parse the form from `body`, writing its `file` part to `writer` (not committed). Raises
    GatewayError 400 (not a form, no file) or 413 (over a limit); the caller aborts the writer."""
    kind, options = parse_options_header(content_type or "")
    boundary = options.get(b"boundary")
    if kind != b"multipart/form-data" or not boundary:
        raise GatewayError(
            400,
            "an upload is multipart/form-data with the fields 'file' and 'purpose'",
            code="invalid_upload",
        )
    upload = Upload()
    part = _Part()
    problem: list[GatewayError] = []
    last_byte = b"\n"

    def on_header_end() -> None:
        part.headers[part.header_field.decode("latin-1").lower()] = bytes(part.header_value)
        part.header_field.clear()
        part.header_value.clear()

    def on_headers_finished() -> None:
        _, disposition = parse_options_header(part.headers.get("content-disposition", b""))
        name = disposition.get(b"name")
        part.name = name.decode("utf-8", "replace") if name is not None else None
        filename = disposition.get(b"filename")
        if part.name == "file":
            part.filename = filename.decode("utf-8", "replace") if filename is not None else "upload.jsonl"
            upload.filename = part.filename

    def on_part_data(data: bytes, start: int, end: int) -> None:
        nonlocal last_byte
        if problem:
            return
        chunk = data[start:end]
        if not chunk:
            return
        if part.name == "file":
            upload.num_bytes += len(chunk)
            upload.num_rows += chunk.count(b"\n")
            last_byte = chunk[-1:]
            if upload.num_bytes > limits.max_bytes:
                problem.append(
                    GatewayError(
                        413, f"the file is over the limit of {limits.max_bytes} bytes", code="file_too_large"
                    )
                )
                return
            if upload.num_rows > limits.max_rows:
                problem.append(
                    GatewayError(413, f"the file has more than {limits.max_rows} rows", code="file_too_large")
                )
                return
            writer.write(chunk)
        else:
            part.value += chunk
            if len(part.value) > MAX_FIELD_BYTES:
                problem.append(
                    GatewayError(400, f"the form field {part.name!r} is too long", param=part.name)
                )

    def on_part_end() -> None:
        nonlocal part
        if part.name is not None and part.name != "file" and not problem:
            if len(upload.fields) >= MAX_FIELDS:
                problem.append(GatewayError(400, "too many form fields"))
            upload.fields[part.name] = part.value.decode("utf-8", "replace")
        part = _Part()

    parser = MultipartParser(
        boundary,
        {
            "on_header_field": lambda data, start, end: part.header_field.extend(data[start:end]),
            "on_header_value": lambda data, start, end: part.header_value.extend(data[start:end]),
            "on_header_end": on_header_end,
            "on_headers_finished": on_headers_finished,
            "on_part_data": on_part_data,
            "on_part_end": on_part_end,
        },
    )
    try:
        async for chunk in body:
            # In a thread: the writer may block (an S3 part upload every few MiB).
            await anyio.to_thread.run_sync(parser.write, chunk)
            if problem:
                raise problem[0]
        parser.finalize()
    except GatewayError:
        raise
    except Exception as exc:  # python-multipart's parse errors
        raise GatewayError(
            400, f"the upload is not a valid multipart form: {exc}", code="invalid_upload"
        ) from None
    if problem:
        raise problem[0]
    if upload.filename is None:
        raise GatewayError(400, "the upload has no 'file' field", param="file", code="invalid_upload")
    if upload.num_bytes and last_byte != b"\n":
        # The last line has no newline: it is a row all the same.
        upload.num_rows += 1
        if upload.num_rows > limits.max_rows:
            raise GatewayError(413, f"the file has more than {limits.max_rows} rows", code="file_too_large")
    return upload
