"""Reply values from queue and store clients as text: redis-py and kombu give bytes or str."""

from __future__ import annotations

from typing import Any


def as_text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
