"""Dials to addresses found on the network (engine/link/found.py): one at a time until one
handshake proves the fleet token, and a wait that grows to an hour after each failed one."""

from __future__ import annotations

from engine.link.found import MAX_WAIT_S, FoundAddresses

A, B = "192.0.2.7:8454", "192.0.2.8:8454"


def test_one_dial_at_a_time_until_the_address_is_proven() -> None:
    found = FoundAddresses()
    assert found.wait_s(A, 0.0) == 0.0  # this dial goes
    assert found.wait_s(A, 0.0) > 0  # the others wait for it
    assert found.wait_s(B, 0.0) == 0.0  # another address is its own
    found.proven(A)
    assert [found.wait_s(A, 0.0) for _ in range(8)] == [0.0] * 8  # every lane dials now


def test_failed_handshakes_wait_longer_each_time_up_to_an_hour() -> None:
    found = FoundAddresses(first_wait_s=10.0)
    now, waits = 0.0, []
    for _ in range(12):
        assert found.wait_s(A, now) == 0.0
        waits.append(found.failed(A, now))
        assert 0 < found.wait_s(A, now + waits[-1] - 1) <= 1  # not a second before
        now += waits[-1]
    assert waits[:4] == [10.0, 20.0, 40.0, 80.0]
    assert waits[-1] == MAX_WAIT_S and max(waits) == MAX_WAIT_S
    assert found.failures(A) == 12
    found.proven(A)  # a peer that holds the token starts again from nothing
    assert found.failures(A) == 0 and found.wait_s(A, now) == 0.0


def test_a_dial_that_sent_nothing_costs_no_wait() -> None:
    found = FoundAddresses()
    assert found.wait_s(A, 0.0) == 0.0
    found.ended(A)  # refused: nothing went out
    assert found.wait_s(A, 0.0) == 0.0 and found.failures(A) == 0


def test_the_memory_is_bounded() -> None:
    found = FoundAddresses(max_addresses=16)
    for n in range(1000):
        found.wait_s(f"10.0.{n // 256}.{n % 256}:8454", 0.0)
        found.failed(f"10.0.{n // 256}.{n % 256}:8454", 0.0)
    assert len(found._known) <= 16
