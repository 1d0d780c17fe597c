"""When this machine may dial an address found on the network (pure; time comes in).

An address found over mDNS or the tailnet is a stranger's claim until its handshake shows
the fleet token, and the fleet id it was announced with is in clear. Each dial sends a
fresh first handshake message, which a fake peer keeps and replays at the fleet's other
machines. So, until an address has answered one handshake:

- one dial at a time goes to it (the others wait for that one: a node's eight lanes do
  not dial a head that has not proven itself eight times over);
- after a handshake that failed once the first message went out, the next waits
  ``FIRST_WAIT_S``, doubling with each failure up to ``MAX_WAIT_S`` (an hour): a fake
  peer gets one message an hour, not one every ten seconds from every lane.

A dial that sent nothing (refused, unreachable) costs no wait: there was nothing to
harvest, and a machine that restarts is found again as soon as it listens.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.backoff import doubling

FIRST_WAIT_S = 10.0
MAX_WAIT_S = 3600.0
MAX_ADDRESSES = 4096  # a scan of many fake peers forgets the oldest, never grows past this


@dataclass(slots=True)
class _Address:
    proven: bool = False
    failures: int = 0  # failed handshakes in a row
    next_at: float = 0.0  # no dial before this
    in_flight: bool = False


class FoundAddresses:
    def __init__(self, *, first_wait_s: float = FIRST_WAIT_S, max_wait_s: float = MAX_WAIT_S,
                 max_addresses: int = MAX_ADDRESSES) -> None:
        self.first_wait_s = first_wait_s
        self.max_wait_s = max_wait_s
        self.max_addresses = max_addresses
        self._known: dict[str, _Address] = {}

    def wait_s(self, address: str, now: float) -> float:
        """0 when a dial to ``address`` may start now (it is then the one in flight, until
        :meth:`proven`, :meth:`failed` or :meth:`ended`); else how long to wait."""
        a = self._entry(address)
        if a.proven:
            return 0.0
        if now < a.next_at:
            return a.next_at - now
        if a.in_flight:
            return 1.0  # the dial in flight decides
        a.in_flight = True
        return 0.0

    def _entry(self, address: str) -> _Address:
        a = self._known.get(address)
        if a is None:
            if len(self._known) >= self.max_addresses:
                del self._known[next(iter(self._known))]  # the oldest address
            a = self._known[address] = _Address()
        return a

    def failures(self, address: str) -> int:
        a = self._known.get(address)
        return a.failures if a is not None else 0

    def proven(self, address: str) -> None:
        """Its handshake completed: it holds the fleet token."""
        a = self._entry(address)
        a.proven, a.failures, a.next_at, a.in_flight = True, 0, 0.0, False

    def failed(self, address: str, now: float) -> float:
        """Its handshake failed after the first message went out; returns the wait."""
        a = self._entry(address)
        a.proven, a.in_flight = False, False
        a.failures += 1
        wait = doubling(self.first_wait_s, a.failures - 1, self.max_wait_s)
        a.next_at = now + wait
        return wait

    def ended(self, address: str) -> None:
        """The dial ended before any message went out: nothing to hold against it."""
        a = self._known.get(address)
        if a is not None:
            a.in_flight = False
