"""How many connections may wait in the handshake at once (pure, no sockets).

A connection costs a file descriptor and a task from the moment it is accepted, and
before the handshake anyone can open one. Capping the connections still in the
handshake, per peer address and in all, keeps a flood from exhausting the process
that also serves the HTTP API; a peer that completed the handshake holds the fleet
token and is no longer counted here.
"""

from __future__ import annotations

from collections import Counter

PER_ADDRESS = 16  # a node opens one connection per lane at once (8 by default)
TOTAL = 128
PRE_HANDSHAKE_S = 3.0  # the Noise handshake is one round trip


class PendingHandshakes:
    def __init__(self, *, per_address: int = PER_ADDRESS, total: int = TOTAL) -> None:
        self.per_address = per_address
        self.total = total
        self._by_address: Counter[str] = Counter()
        self._count = 0
        self.refused = 0  # connections turned away, for the logs and tests

    def __len__(self) -> int:
        return self._count

    def admit(self, address: str) -> bool:
        """Whether a new connection from ``address`` may start its handshake."""
        if self._count >= self.total or self._by_address[address] >= self.per_address:
            self.refused += 1
            return False
        self._by_address[address] += 1
        self._count += 1
        return True

    def release(self, address: str) -> None:
        """Its handshake ended (done, failed or timed out)."""
        if self._by_address[address] > 0:
            self._by_address[address] -= 1
            self._count -= 1
            if not self._by_address[address]:
                del self._by_address[address]
