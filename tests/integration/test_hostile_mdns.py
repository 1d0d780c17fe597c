"""A flood of real mDNS announcements on loopback (see test_mdns.py: zeroconf bound to
127.0.0.1 only, so nothing leaves this machine): valid announcements of another fleet
and announcements whose records are nonsense, far more than a browser keeps."""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket

import pytest
from zeroconf import IPVersion
from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf

from engine.discovery import mdns
from engine.discovery.fleet_id import fleet_id
from engine.discovery.mdns import SERVICE_TYPE, Announcer, Browser
from tests.drills.record import record
from tests.waiting import until

LO = ["127.0.0.1"]
KEEP = 8  # the browser's bound in this test (MAX_SERVICES, 256 by default)
FLOOD = 48

pytestmark = pytest.mark.timeout(90)


def flood_info(i: int, tag: str, theirs: str) -> AsyncServiceInfo:
    """Every third one a valid node of another fleet; the rest nonsense of all kinds."""
    props: dict[str, str | bytes | None]
    match i % 3:
        case 0:
            props = {"v": "1", "role": "node", "model": "m" * 200, "fleet": theirs}
        case 1:
            props = {"v": "not-a-number", "role": "head", "fleet": "\x00" * 40}
        case _:
            props = {"role": "x" * 200, "v": None, "junk": bytes(range(200))}
    return AsyncServiceInfo(SERVICE_TYPE, f"flood-{tag}-{i}.{SERVICE_TYPE}", port=1 + i,
                            properties=props, server=f"flood-{tag}-{i}.local.",
                            addresses=[socket.inet_aton("127.0.0.1")])


async def test_an_announcement_flood_keeps_the_browser_bounded(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    monkeypatch.setattr(mdns, "MAX_SERVICES", KEEP)
    tag = secrets.token_hex(3)
    ours, theirs = fleet_id(secrets.token_bytes(32)), fleet_id(secrets.token_bytes(32))
    browser = Browser(interfaces=LO)
    flooder = AsyncZeroconf(interfaces=LO, ip_version=IPVersion.V4Only)
    head = Announcer()
    most = 0

    def held() -> int:
        """Services held now (found or being resolved), noting the most seen."""
        nonlocal most
        now = len(browser.all_found()) + len(browser._resolving)
        most = max(most, now)
        return now

    await browser.start()
    try:
        infos = [flood_info(i, tag, theirs) for i in range(FLOOD)]
        pending = await asyncio.gather(*(flooder.async_register_service(info)
                                         for info in infos))
        await asyncio.gather(*pending)
        await until(lambda: held() >= 0 and browser._full_warned,
                    "the browser to say it is full", timeout=30)
        # the valid ones it kept resolve; none of another fleet passes for ours
        await until(lambda: held() == len(browser.all_found()), "resolutions to settle",
                    timeout=30)
        assert most <= KEEP, most
        assert browser.found(ours, None) == []
        kept = browser.all_found()
        assert all(f.fleet == theirs and f.role == "node" for f in kept), kept
        # the flood goes (goodbyes): a head of our fleet is found again
        await flooder.async_unregister_all_services()
        await until(lambda: not any(f.name.startswith(f"flood-{tag}")
                                    for f in browser.all_found()),
                    "the flood's services to go", timeout=30)
        await head.start(instance=f"head-{tag}", port=8454, role="head", model="m",
                         fleet=ours, addresses=["127.0.0.1"], interfaces=LO)
        found = await until(lambda: browser.found(ours, "head"), "our head", timeout=30)
        assert [f.name for f in found] == [f"head-{tag}"]
    finally:
        await head.close()
        await flooder.async_close()
        await browser.close()
    warnings = [r for r in caplog.records if "Shoal services announced" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "Traceback" not in caplog.text
    record("mdns_flood", kind="hostile",
           tried=f"{FLOOD} real mDNS announcements on loopback at once (valid nodes of "
                 "another fleet, nonsense TXT records: bad versions and roles, NULs, 200-byte "
                 f"values, raw bytes) against a browser that keeps {KEEP}",
           times=FLOOD,
           outcome=f"the browser held at most {most} services and logged one warning; "
                   f"{len(kept)} kept, all valid and none taken for our fleet; once the "
                   "flood said goodbye a head of our fleet was found",
           tokens_lost=None, failed_clear=None)
