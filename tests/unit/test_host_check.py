"""The Host check against DNS rebinding: the pure decision, the allow-list, and the
gate's look-up of this machine's names (clock and names injected, no sockets)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine.api.auth import NAMES_REFRESH_S, Gate
from engine.head.access.hosts import (
    HostError,
    host_allowed,
    host_of,
    machine_names,
    parse_allowed_hosts,
)

OWN = frozenset({"deskbox", "deskbox.local", "deskbox.lan.example", "192.168.1.20",
                 "fd00::20"})
NONE: tuple[str, ...] = ()


@pytest.mark.parametrize("host", [
    None, "", "  ",  # HTTP/1.0, or a request with no authority
    "127.0.0.1", "127.0.0.1:8453", "127.8.9.10:80", "localhost", "localhost:8453",
    "LOCALHOST:8453", "localhost.", "app.localhost", "a.b.localhost:3000",
    "[::1]", "[::1]:8453", "::1", "[::ffff:127.0.0.1]:8453",
    "0.0.0.0:8453", "[::]:8453",
])
def test_loopback_names_are_served(host: str | None) -> None:
    assert host_allowed(host, NONE, frozenset())


@pytest.mark.parametrize("host", [
    "deskbox", "DeskBox:8453", "deskbox.local:8453", "deskbox.lan.example.",
    "192.168.1.20:8453", "[fd00::20]:8453", "[FD00:0::20]",
])
def test_this_machines_names_and_addresses_are_served(host: str) -> None:
    assert host_allowed(host, NONE, OWN)
    assert not host_allowed(host, NONE, frozenset())


@pytest.mark.parametrize("host", [
    "evil.example", "evil.example:8453", "127.0.0.1.evil.example", "localhost.evil.example",
    "localhostx", "deskbox.evil.example", "192.168.1.21", "[fd00::21]:8453",
    "10.0.0.1:8453",
    # malformed: no guessing
    "localhost:port", "localhost:123456", "[::1", "[::1]x", "[]:80", ":8453", "[::1]:8453:1",
])
def test_every_other_host_is_refused(host: str) -> None:
    assert not host_allowed(host, NONE, OWN)


def test_the_allow_list() -> None:
    allowed = parse_allowed_hosts(["shoal.example.com,*.ts.net", "10.0.0.5"])
    assert allowed == ("shoal.example.com", "*.ts.net", "10.0.0.5")
    assert host_allowed("shoal.example.com:443", allowed, frozenset())
    assert host_allowed("SHOAL.example.com", allowed, frozenset())
    assert host_allowed("box.tail1234.ts.net", allowed, frozenset())
    assert host_allowed("10.0.0.5:8453", allowed, frozenset())
    assert not host_allowed("ts.net", allowed, frozenset())  # *.x is below x only
    assert not host_allowed("evilts.net", allowed, frozenset())
    assert not host_allowed("shoal.example.com.evil.example", allowed, frozenset())
    assert host_allowed("anything.example:1", parse_allowed_hosts(["*"]), frozenset())


def test_allow_list_entries_are_normalised_and_checked() -> None:
    assert parse_allowed_hosts(["Proxy.Example:8443", " [fd00::1]:80 ", "", "a,a"]) == (
        "proxy.example", "fd00::1", "a")
    for bad in ("http://x.example", "*x.example", "a.*.example", "x:port", "[::1"):
        with pytest.raises(HostError) as exc:
            parse_allowed_hosts([bad])
        assert "--allow-host" in str(exc.value) and "\n" not in str(exc.value)


def test_host_of() -> None:
    assert host_of("Example.COM.:8453") == "example.com"
    assert host_of("[::FFFF:127.0.0.1]:1") == "127.0.0.1"
    assert host_of("[fe80::1%25eth0]:1") == "fe80::1"  # the zone is not part of the name
    assert host_of("a:b") is None


def test_machine_names_hold_the_host_name_and_loopback_addresses() -> None:
    import socket

    names = machine_names()
    assert socket.gethostname().lower() in names
    assert "127.0.0.1" in names  # the loopback interface, as ifaddr lists it


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_gate_looks_up_this_machines_names_again_when_a_host_misses() -> None:
    clock = Clock()
    lookups: list[float] = []
    addresses = {"192.168.1.20"}

    def names() -> frozenset[str]:
        lookups.append(clock.now)
        return frozenset(addresses)

    head = SimpleNamespace(allowed_hosts=("proxy.example",), host_names=frozenset({"deskbox"}))
    gate = Gate(head, clock=clock, names=names)
    # loopback, the names found at start and allowed hosts need no look-up
    assert gate.host_ok("127.0.0.1:8453") and gate.host_ok("deskbox:8453")
    assert gate.host_ok("proxy.example") and gate.host_ok(None)
    assert lookups == []
    assert gate.host_ok("192.168.1.20:8453") and lookups == [1000.0]
    # a new address (DHCP, a VPN coming up) is found on a miss, at most so often
    addresses.add("100.64.0.7")
    assert not gate.host_ok("evil.example")  # looked up at 1000: not again yet
    assert not gate.host_ok("100.64.0.7")
    assert lookups == [1000.0]
    clock.now += NAMES_REFRESH_S
    assert gate.host_ok("100.64.0.7") and lookups == [1000.0, clock.now]
    assert not gate.host_ok("evil.example") and len(lookups) == 2
