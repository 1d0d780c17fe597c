"""Pure guards against strangers: pending handshakes, plaintext off loopback, and which
addresses a listener announces. No sockets."""

from __future__ import annotations

import asyncio

import pytest

from engine.discovery.service import announced_addresses
from engine.link import transport
from engine.link.admission import PendingHandshakes
from engine.link.connection import LinkError, LinkErrorKind


def test_at_a_cap_the_oldest_unproven_connection_makes_way() -> None:
    p: PendingHandshakes[str] = PendingHandshakes(per_address=2, total=3)
    assert p.admit("a1", "a") == [] and p.admit("a2", "a") == []
    assert p.admit("a3", "a") == ["a1"]  # a third from one address pushes out its oldest
    assert p.admit("b1", "b") == []
    assert p.admit("c1", "c") == ["a2"]  # the total is reached: the oldest of all goes
    assert len(p) == 3 and p.dropped == 2
    p.release("a3")
    assert p.admit("c2", "c") == []
    p.release("x")  # never admitted (or pushed out already): nothing changes
    p.release("a1")
    assert len(p) == 3


def test_a_flood_from_many_addresses_never_refuses_the_newest() -> None:
    """128 silent connections from 8 addresses once shut out every real peer."""
    p: PendingHandshakes[int] = PendingHandshakes(per_address=16, total=128)
    for n in range(1000):
        p.admit(n, f"10.0.0.{n % 8}")
    assert len(p) == 128 and p.dropped == 1000 - 128
    assert p.admit(-1, "192.168.1.20") == [1000 - 128]  # the oldest flood connection goes
    assert len(p) == 128


def test_released_addresses_are_forgotten() -> None:
    p: PendingHandshakes[str] = PendingHandshakes(per_address=1, total=10)
    for i in range(1000):
        p.admit(f"k{i}", f"10.0.{i // 256}.{i % 256}")
    for i in range(990, 1000):
        p.release(f"k{i}")
    assert len(p) == 0 and not p._by_address and not p._pending


def test_no_plaintext_link_leaves_this_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    async def never(*args: object, **kw: object) -> None:
        raise AssertionError("dialed the network")

    monkeypatch.setattr(asyncio, "open_connection", never)
    for host in ("192.0.2.10", "10.0.0.5", "100.64.1.2", "box.local", "::ffff:192.0.2.1"):
        with pytest.raises(LinkError) as err:
            asyncio.run(transport.dial(host, 8455, psk=None))
        assert err.value.kind is LinkErrorKind.PLAINTEXT_OFF_LOOPBACK
        assert "shoal fleet token" in str(err.value)


@pytest.mark.parametrize(("bound", "announced"), [
    ("0.0.0.0", None), ("", None), ("::", None),
    ("127.0.0.1", []), ("127.0.0.5", []), ("::1", []), ("localhost", []),
    ("192.168.1.20", ["192.168.1.20"]), ("100.101.102.103", ["100.101.102.103"]),
])
def test_a_listener_announces_only_where_it_accepts(bound: str,
                                                     announced: list[str] | None) -> None:
    assert announced_addresses(bound) == announced
