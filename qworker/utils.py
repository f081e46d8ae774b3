"""Small helpers shared by the engine and the worker. Nothing here imports torch."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ints: how many blocks of size b hold a items."""
    return -(-a // b)
