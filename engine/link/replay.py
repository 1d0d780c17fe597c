"""Which first handshake messages a responder takes: fresh ones, each once (pure).

NNpsk0's first message is ``e`` and a payload under a key that only the PSK and ``e``
give; nothing in it comes from the responder. So a copy of one captured message (or
one obtained by getting a head to dial a fake node) completes the responder's side of
the handshake as well as the original did, at every responder of the fleet, as often
as it is sent. The initiator therefore puts the time it sent the message inside the
authenticated payload, and the responder takes a message only:

- when that time is within ``WINDOW_S`` of its own clock (clocks set by network time
  agree to well under a second; a few minutes leaves room for a machine that drifted),
- and when its ephemeral key has not been seen yet: every key taken is remembered
  until its time leaves the window, after which the time alone refuses it.

WireGuard guards its handshake initiation the same way (a TAI64N timestamp).

The memory is bounded, and full it forgets the oldest key rather than refuse a new one.
Refusing (failing closed) let a stranger shut the fleet out: the fleet id is in clear in
mDNS, so fake heads and nodes announced with it get the fleet's machines to dial them,
and each dial hands the stranger a fresh first message to replay at every other machine.
Forgetting costs nothing a replay could gain: a message taken twice completes a handshake
whose keys only its maker holds, so no hello follows it, and the connection is dropped as
unproven (:mod:`engine.link.admission`).
"""

from __future__ import annotations

import enum
import heapq
import struct

WINDOW_S = 300.0
MAX_REMEMBERED = 16384  # 16,384 handshakes in ten minutes: far above any fleet's own rate
STAMP = struct.Struct(">Q")  # the initiator's wall clock, milliseconds since the epoch


class Verdict(enum.Enum):
    FRESH = "fresh"
    REPLAYED = "replayed"
    SKEWED = "skewed"  # outside the window: a copy of an old message, or a wrong clock


def stamp(now: float) -> bytes:
    """The payload of a first handshake message sent at ``now`` (seconds since the epoch)."""
    return STAMP.pack(max(0, round(now * 1000)))


def read_stamp(payload: bytes) -> float | None:
    """The time in a first message's payload, or None when it holds none."""
    if len(payload) != STAMP.size:
        return None
    return float(STAMP.unpack(payload)[0]) / 1000


def explain(verdict: Verdict, sent_at: float, now: float) -> str:
    """One line: why a handshake was refused, and what to do."""
    if verdict is Verdict.REPLAYED:
        return ("a copy of a handshake this machine already took (a replayed message: "
                "someone on the network is copying this fleet's traffic)")
    if verdict is Verdict.SKEWED:
        return (f"the peer's clock is {abs(now - sent_at):.0f} s "
                f"{'behind' if sent_at < now else 'ahead of'} this machine's (more than "
                f"{WINDOW_S:.0f} s), or the message is an old copy; turn on network time "
                "on both machines")
    return "fresh"


class ReplayGuard:
    """The ephemeral keys of the first messages taken, each until its time leaves the
    window, or until ``max_remembered`` newer ones push it out. ``check`` is the whole
    decision; time comes in as an argument."""

    def __init__(self, *, window_s: float = WINDOW_S,
                 max_remembered: int = MAX_REMEMBERED) -> None:
        self.window_s = window_s
        self.max_remembered = max_remembered
        self._expiry: dict[bytes, float] = {}
        self._order: list[tuple[float, bytes]] = []  # a heap of (expiry, key)
        self.forgotten = 0  # keys pushed out before their time, for the logs and tests

    def __len__(self) -> int:
        return len(self._expiry)

    def check(self, key: bytes, sent_at: float, now: float) -> Verdict:
        """Whether the first message with ephemeral ``key``, stamped ``sent_at``, is taken
        at ``now``; a taken key is remembered, so the same message is refused next time."""
        self._forget_expired(now)
        if abs(now - sent_at) > self.window_s:
            return Verdict.SKEWED
        if key in self._expiry:
            return Verdict.REPLAYED
        while len(self._expiry) >= self.max_remembered:
            _, oldest = heapq.heappop(self._order)  # the soonest to expire
            del self._expiry[oldest]
            self.forgotten += 1
        expiry = sent_at + self.window_s  # after that, the time alone refuses the copy
        self._expiry[key] = expiry
        heapq.heappush(self._order, (expiry, key))
        return Verdict.FRESH

    def _forget_expired(self, now: float) -> None:
        order = self._order
        while order and order[0][0] < now:
            _, key = heapq.heappop(order)
            del self._expiry[key]
