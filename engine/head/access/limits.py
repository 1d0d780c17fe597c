"""Per-key request rate limit as a token bucket: pure functions, time passed in.

A bucket holds up to ``burst`` tokens and refills at ``rate_per_s``; each request
takes ``cost`` tokens (1 by default). A refused request learns how long until
enough tokens are back, for the 429's Retry-After (the caller rounds it up).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Refill arithmetic on float timestamps drifts by ~1e-15; without this slack a
# request exactly on time could be refused with a Retry-After of zero.
_EPSILON = 1e-9


@dataclass(frozen=True, slots=True)
class Bucket:
    tokens: float
    stamp: float  # when `tokens` was last brought up to date


def fresh(now: float, burst: float) -> Bucket:
    """A new key starts with a full bucket, so its first burst goes through."""
    return Bucket(burst, now)


def take(
    bucket: Bucket, now: float, rate_per_s: float, burst: float, *, cost: float = 1.0
) -> tuple[bool, Bucket, float]:
    """Try to take ``cost`` tokens: (allowed, new bucket, retry_after_s; 0.0 when allowed)."""
    # A clock that steps backwards refills nothing and does not move the stamp back,
    # or the same interval would be credited twice.
    elapsed = max(0.0, now - bucket.stamp)
    tokens = min(burst, bucket.tokens + elapsed * rate_per_s)
    stamp = max(now, bucket.stamp)
    if tokens + _EPSILON >= cost:
        return True, Bucket(max(0.0, tokens - cost), stamp), 0.0
    if rate_per_s <= 0 or cost > burst:
        return False, Bucket(tokens, stamp), math.inf  # can never be granted
    return False, Bucket(tokens, stamp), (cost - tokens) / rate_per_s
