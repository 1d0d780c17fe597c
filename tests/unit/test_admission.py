"""Pure guards against strangers: pending handshakes, plaintext off loopback, and which
addresses a listener announces. No sockets."""

from __future__ import annotations

import asyncio

import pytest

from engine.discovery.service import announced_addresses
from engine.link import transport
from engine.link.admission import PendingHandshakes
from engine.link.connection import LinkError, LinkErrorKind


def test_pending_handshakes_are_capped_per_address_and_in_all() -> None:
    p = PendingHandshakes(per_address=2, total=3)
    assert p.admit("a") and p.admit("a")
    assert not p.admit("a")  # a third from one address waits for one to end
    assert p.admit("b")
    assert not p.admit("c")  # the total is reached
    assert len(p) == 3 and p.refused == 2
    p.release("a")
    assert p.admit("c")
    p.release("x")  # never admitted: nothing changes
    assert len(p) == 3


def test_released_addresses_are_forgotten() -> None:
    p = PendingHandshakes(per_address=1, total=10)
    for i in range(1000):
        assert p.admit(f"10.0.{i // 256}.{i % 256}") is (i < 10)
    for i in range(10):
        p.release(f"10.0.0.{i}")
    assert len(p) == 0 and not p._by_address


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
