"""The wait after repeated failures: doubling from a first wait up to a ceiling (pure)."""

from __future__ import annotations


def doubling(first_s: float, step: int, most_s: float) -> float:
    """The wait at ``step`` (0: the first failure that waits), ``first_s`` doubled once
    per step after it, at most ``most_s``."""
    return min(first_s * 2.0 ** min(max(step, 0), 32), most_s)
