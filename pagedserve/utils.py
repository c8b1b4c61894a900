"""Small pure-Python helpers used across the package (no torch: `core/` imports this)."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of `b` hold `a` items."""
    return -(-a // b)


def is_int(x: object) -> bool:
    """An integer that is not a bool (True is an int to Python, never a count to us)."""
    return isinstance(x, int) and not isinstance(x, bool)
