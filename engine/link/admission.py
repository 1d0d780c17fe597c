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
hello is read, and that whole wait is bounded by ``PRE_HELLO_S``.
"""

from __future__ import annotations

from collections import Counter

PER_ADDRESS = 16  # a node opens one connection per lane at once (8 by default)
TOTAL = 128
PRE_HELLO_S = 3.0  # the handshake and the hellos: two round trips


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
        """Its peer's hello was read, or the connection failed or timed out first."""
        if self._by_address[address] > 0:
            self._by_address[address] -= 1
            self._count -= 1
            if not self._by_address[address]:
                del self._by_address[address]
