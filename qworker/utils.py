"""Small helpers shared by the engine, the backends and the worker. Nothing here imports torch."""

from __future__ import annotations

from typing import Any


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ints: how many blocks of size b hold a items."""
    return -(-a // b)


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
