"""Text helpers: reply values from queue and store clients as text (redis-py and kombu give bytes
or str), and whether a string can be stored at all."""

from __future__ import annotations

from typing import Any


def as_text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def is_utf8_text(text: str) -> bool:
    """True when `text` encodes to UTF-8: no lone surrogates (which JSON escapes can produce, and
    which no store, key or log line can hold)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True
