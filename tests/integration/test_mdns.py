"""mDNS on loopback: zeroconf bound to 127.0.0.1 only, so nothing leaves this machine.

Linux delivers multicast sent on ``lo`` back to every socket joined there, so an
announcer and a browser in one process find each other without any other host.
Each test uses its own fleet id and instance names, so tests running at the
same time (or other Shoal processes announcing on loopback) do not interfere.
"""

from __future__ import annotations

import asyncio
import ipaddress
import secrets
from collections.abc import AsyncIterator

import pytest

from engine.discovery.fleet_id import OPEN_FLEET, fleet_id, is_fleet_id
from engine.discovery.mdns import (
    PROTOCOL_VERSION,
    Announcer,
    Browser,
    Found,
    local_addresses,
    pick_host,
)
from tests.waiting import until

LO = ["127.0.0.1"]


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    b = Browser(interfaces=LO)
    await b.start()
    yield b
    await b.close()


def test_fleet_id_is_one_way_and_stable() -> None:
    token = bytes(range(32))
    fid = fleet_id(token)
    assert fid == fleet_id(bytes(range(32)))
    assert len(fid) == 16 and is_fleet_id(fid)
    assert fid != fleet_id(secrets.token_bytes(32))
    assert token.hex()[:16] not in fid and fid not in token.hex()
    assert fleet_id(None) == OPEN_FLEET and is_fleet_id(OPEN_FLEET)
    assert not is_fleet_id("ZZ" * 8)


def test_announced_addresses_are_real_interfaces() -> None:
    for addr in local_addresses():
        ip = ipaddress.IPv4Address(addr)
        assert not ip.is_loopback and not ip.is_link_local


def test_pick_host_dials_only_this_machines_networks() -> None:
    nets = [ipaddress.IPv4Network("10.9.0.0/16"), ipaddress.IPv4Network("127.0.0.0/8")]
    assert pick_host(["192.168.1.4", "10.9.3.3"], nets) == "10.9.3.3"
    assert pick_host(["127.0.0.1", "10.9.3.3"], nets) == "10.9.3.3"
    assert pick_host(["127.0.0.1"], nets) == "127.0.0.1"
    # an announcement that names addresses off this machine's networks is not dialed
    assert pick_host(["192.168.1.4", "8.8.8.8"], nets) == ""
    assert pick_host(["127.0.0.1", "192.168.1.4"], []) == ""
    assert pick_host(["nonsense", "169.254.1.1", "0.0.0.0"], nets) == ""


async def test_announce_then_browse_finds_txt(browser: Browser) -> None:
    fid = fleet_id(secrets.token_bytes(32))
    instance = f"head-{secrets.token_hex(4)}"
    announcer = Announcer()
    await announcer.start(instance=instance, port=8454, role="head", model="smollm2-135m",
                          fleet=fid, addresses=["127.0.0.1"], interfaces=LO)
    try:
        assert announcer.name == instance
        await until(lambda: browser.found(fid, "head"), "the head found")
        [head] = browser.found(fid, "head")
        assert head == Found(name=instance, host="127.0.0.1", port=8454, role="head",
                             model="smollm2-135m", fleet=fid, protocol=PROTOCOL_VERSION,
                             source="lan")
        assert head.addresses == ("127.0.0.1",)
        assert browser.found(fid, "node") == []

        await announcer.update(model="gemma-3-270m")
        await until(lambda: [f.model for f in browser.found(fid, "head")] == ["gemma-3-270m"],
                    "the new model announced")
    finally:
        await announcer.close()
    await until(lambda: not browser.found(fid, None), "the head gone")


async def test_other_fleet_is_filtered(browser: Browser) -> None:
    ours, theirs = fleet_id(secrets.token_bytes(32)), fleet_id(secrets.token_bytes(32))
    tag = secrets.token_hex(4)
    a, b = Announcer(), Announcer()
    await asyncio.gather(
        a.start(instance=f"ours-{tag}", port=9001, role="head", model="m", fleet=ours,
                interfaces=LO),
        b.start(instance=f"theirs-{tag}", port=9002, role="head", model="m", fleet=theirs,
                interfaces=LO))
    try:
        await until(lambda: browser.found(ours, "head") and browser.found(theirs, "head"),
                    "both fleets' heads found")
        assert [f.port for f in browser.found(ours, "head")] == [9001]
        assert [f.port for f in browser.found(theirs, "head")] == [9002]
        both = {f.name for f in browser.found(None, "head")}
        assert {f"ours-{tag}", f"theirs-{tag}"} <= both
    finally:
        await asyncio.gather(a.close(), b.close())


async def test_unregister_makes_it_disappear(browser: Browser) -> None:
    fid = fleet_id(secrets.token_bytes(32))
    announcer = Announcer()
    await announcer.start(instance=f"node-{secrets.token_hex(4)}", port=8455, role="node",
                          model="m", fleet=fid, interfaces=LO)
    try:
        await until(lambda: browser.found(fid, "node"), "the node found")
    finally:
        seen = browser.changes
        await announcer.close()
        await announcer.close()  # idempotent
    await until(lambda: not browser.found(fid, "node"), "the node gone")
    assert browser.changes > seen


async def test_wait_change_times_out_quietly(browser: Browser) -> None:
    assert await browser.wait_change(0.05) is False
    assert await browser.wait_change(0.05, since=browser.changes - 1) is True
