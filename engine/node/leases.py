"""Session leases on a node: pure functions, time passed in as seconds.

The head renews each running session's lease; once a lease has expired the node
fences the session (emits nothing more, frees the lane).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Lease:
    deadline: float


def grant(now: float, ttl_s: float) -> Lease:
    return Lease(now + ttl_s)


def renew(lease: Lease, now: float, ttl_s: float) -> Lease:
    # A fenced session stays fenced: a late renewal must not revive output the
    # head has already given up on and may have re-placed elsewhere.
    if expired(lease, now):
        return lease
    # Never shorten: a renewal with a smaller ttl (or reordered) keeps the later deadline.
    return Lease(max(lease.deadline, now + ttl_s))


def expired(lease: Lease, now: float) -> bool:
    return now > lease.deadline
