"""How many connections may wait to show the fleet token at once (pure, no sockets).

A connection costs a file descriptor and a task from the moment it is accepted, and
before it has shown the token anyone can open one. Capping the connections not yet
proven, per peer address and in all, keeps a flood from exhausting the process that
also serves the HTTP API.

A completed responder handshake proves nothing: NNpsk0's first message comes from
the dialer alone, so a copy of one captured (or obtained by getting a head to dial a
fake node) completes it too. What proves the token is the dialer's hello, the first
record under the transport keys, which only the holder of the ephemeral key made
for that message can write. So a connection is counted from its accept until that
hello is read, and that whole wait is bounded by ``PRE_HELLO_S``; the first message,
which a real dialer sends as soon as it connects, has ``FIRST_MESSAGE_S``.

At a cap the oldest unproven connection makes way for the new one (of that address at
its own cap, else of all): refusing the new one let 128 silent connections from 8
addresses shut out every real peer for as long as the flood went on, while a real
dialer's whole wait is a round trip, far shorter than a flood can keep the oldest
place.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)

PER_ADDRESS = 16  # a node opens one connection per lane at once (8 by default)
TOTAL = 128
PRE_HELLO_S = 3.0  # the handshake and the hellos: two round trips
FIRST_MESSAGE_S = 1.0  # a real dialer writes its first message right after connecting


class PendingHandshakes(Generic[K]):
    """The connections not yet proven, oldest first; each known by a key its owner
    chooses (the accepted connection), so that one pushed out can be closed."""

    def __init__(self, *, per_address: int = PER_ADDRESS, total: int = TOTAL) -> None:
        self.per_address = per_address
        self.total = total
        self._pending: dict[K, str] = {}  # key -> address, in admission order
        self._by_address: Counter[str] = Counter()
        self.dropped = 0  # connections pushed out by newer ones, for the logs and tests

    def __len__(self) -> int:
        return len(self._pending)

    def admit(self, key: K, address: str) -> list[K]:
        """Count the new connection ``key`` from ``address``; returns the keys of older
        unproven connections it pushed out, for the caller to close."""
        dropped: list[K] = []
        if self._by_address[address] >= self.per_address:
            dropped.append(next(k for k, a in self._pending.items() if a == address))
            self.release(dropped[-1])
        if len(self._pending) >= self.total:
            dropped.append(next(iter(self._pending)))
            self.release(dropped[-1])
        self._pending[key] = address
        self._by_address[address] += 1
        self.dropped += len(dropped)
        return dropped

    def release(self, key: K) -> None:
        """Its peer's hello was read, or the connection failed, timed out or was pushed
        out (a key no longer counted changes nothing)."""
        address = self._pending.pop(key, None)
        if address is None:
            return
        self._by_address[address] -= 1
        if not self._by_address[address]:
            del self._by_address[address]
