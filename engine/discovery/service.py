"""Discovery wired together: heads announce themselves, joining nodes look for them.

On the LAN a head announces ``_shoal-fleet._tcp.local.`` with its fleet id (one-way
from the token), so a node picks its own fleet's head without the token leaving
either machine. On a tailnet the node asks tailscaled for the online peers and
tries the head port on each: only a head holding the same token completes the
handshake. Seeds are tried as given. Offline tailnet devices are never dialed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from engine.discovery.fleet_id import fleet_id
from engine.discovery.mdns import Announcer, Browser
from engine.link import messages as m
from engine.link.connection import LinkError
from engine.link.hello import exchange_hellos
from engine.link.transport import LinkClosed, dial, is_loopback
from engine.node.join import HeadAddress, JoinRefused, probe_head
from engine.settings import FLEET_PORT

log = logging.getLogger("shoal.discovery")

PROBE_TIMEOUT_S = 2.0
MAX_PROBES = 64  # tailnet peers tried per round


def _modes(mode: str) -> tuple[bool, bool]:
    return mode in ("lan", "both"), mode in ("tailnet", "both")


def announced_addresses(bound_host: str) -> list[str] | None:
    """The addresses to announce for a listener bound to ``bound_host``: None for every
    interface (a wildcard bind), [] when it takes only this machine (loopback), else that
    one address. Announcing an address the listener does not accept on would send every
    peer that finds it into a dial loop."""
    if bound_host in ("", "0.0.0.0", "::"):  # noqa: S104 - comparing, not binding
        return None
    if is_loopback(bound_host):
        return []
    return [bound_host]


async def announce_head(mode: str, *, head_id: str, model: str, psk: bytes | None,
                        port: int, host: str = "0.0.0.0",  # noqa: S104
                        ) -> list[Callable[[], Awaitable[None]]]:
    """Announce this head (``head_id``, serving ``model``) on the LAN (the tailnet needs
    no announcement)."""
    lan, _ = _modes(mode)
    addresses = announced_addresses(host)
    if not lan:
        return []
    if addresses == []:
        log.info("not announcing this head on the LAN: its fleet listener takes this machine "
                 "only (%s); listen on 0.0.0.0 or a LAN address for other machines", host)
        return []
    announcer = Announcer()
    try:
        await announcer.start(instance=f"shoal-head-{head_id}", port=port, role="head",
                              model=model, fleet=fleet_id(psk), addresses=addresses)
    except OSError as exc:
        log.warning("cannot announce this head on the LAN (%s); nodes can still join by "
                    "address or over the tailnet", exc)
        return []
    log.info("announced on the LAN as a head of fleet %s", fleet_id(psk))
    return [announcer.close]


async def announce_node(mode: str, *, identity: str, model: str, psk: bytes | None,
                        port: int, host: str = "0.0.0.0",  # noqa: S104
                        ) -> list[Callable[[], Awaitable[None]]]:
    """Announce a listening node on the LAN, so heads of its fleet dial it."""
    lan, _ = _modes(mode)
    addresses = announced_addresses(host)
    if not lan or addresses == []:
        return []
    announcer = Announcer()
    try:
        await announcer.start(instance=f"shoal-node-{identity}", port=port, role="node",
                              model=model, fleet=fleet_id(psk), addresses=addresses)
    except OSError as exc:
        log.warning("cannot announce this node on the LAN (%s); heads can still dial it by "
                    "address", exc)
        return []
    return [announcer.close]


async def probe_node(node: HeadAddress, *, psk: bytes | None,
                     timeout_s: float = PROBE_TIMEOUT_S) -> m.NodeHello | None:
    """A node of this fleet listening there says hello; anything else is None."""
    try:
        link = await dial(node.host, node.port, psk=psk, timeout_s=timeout_s, found=node.found)
    except (OSError, TimeoutError, LinkError):
        return None
    try:
        return await exchange_hellos(link, None, responder=False, expect=m.NodeHello,
                                     timeout_s=timeout_s)
    except (TimeoutError, LinkClosed):  # a wrong peer too
        return None
    finally:
        link.close()


class HeadFinder:
    """Where a joining node looks for the heads of its fleet (or a head for its nodes)."""

    def __init__(self, mode: str, *, psk: bytes | None, seeds: list[str],
                 tailscale_socket: str | None, head_port: int = FLEET_PORT,
                 role: str = "head", clock: Callable[[], float] = time.monotonic) -> None:
        self.role = role
        self._clock = clock
        self.lan, self.tailnet = _modes(mode)
        self.psk = psk
        self.fleet = fleet_id(psk)
        self.seeds = seeds
        self.tailscale_socket = tailscale_socket
        self.head_port = head_port
        self._browser: Browser | None = None
        self._problems: list[str] = []

    async def start(self) -> None:
        if self.lan:
            browser = Browser()
            try:
                await browser.start()
            except OSError as exc:
                self._problems.append(f"mDNS unavailable: {exc}")
                return
            self._browser = browser

    async def close(self) -> None:
        browser = self._browser
        if browser is not None:
            self._browser = None
            await browser.close()

    def where_looked(self) -> str:
        places = []
        if self.lan:
            places.append("on the LAN over mDNS")
        if self.tailnet:
            places.append("on the tailnet")
        if self.seeds:
            places.append(f"at the seeds {', '.join(self.seeds)}")
        text = " and ".join(places) if places else "nowhere: discovery is off"
        if self._problems:
            text += "; " + "; ".join(self._problems)
        return text

    async def find(self, timeout_s: float) -> list[HeadAddress]:
        """Heads of this fleet, LAN first, then tailnet and seeds (in that order)."""
        self._problems = []
        found: list[HeadAddress] = []
        jobs: list[Awaitable[list[HeadAddress]]] = []
        if self.lan and self._browser is not None:
            jobs.append(self._lan(timeout_s))
        if self.tailnet:
            jobs.append(self._tailnet())
        if self.seeds:
            jobs.append(self._seeds())
        for result in await asyncio.gather(*jobs):
            for head in result:
                if all((h.host, h.port) != (head.host, head.port) for h in found):
                    found.append(head)
        return found

    async def _lan(self, timeout_s: float) -> list[HeadAddress]:
        browser = self._browser
        assert browser is not None
        deadline = self._clock() + timeout_s
        while True:
            heads = [HeadAddress(f.host, f.port, "lan")
                     for f in browser.found(self.fleet, self.role)]
            remaining = deadline - self._clock()
            if heads or remaining <= 0:
                if not heads and self.role == "head":
                    others = browser.found(None, "head")
                    if others:
                        self._problems.append(
                            f"found {len(others)} head(s) of another fleet on the LAN "
                            f"({', '.join(f'{f.host}:{f.port}' for f in others[:3])}); pair "
                            "with your own head: `shoal fleet pair` there")
                return heads
            await browser.wait_change(min(remaining, 0.5))

    async def _tailnet(self) -> list[HeadAddress]:
        from engine.discovery.tailscale import (
            TailscaleError,
            default_endpoint,
            online_peer_addresses,
            status,
        )

        try:
            st = await status(default_endpoint(self.tailscale_socket))
        except TailscaleError as exc:
            self._problems.append(str(exc))
            return []
        peers = online_peer_addresses(st)[:MAX_PROBES]
        candidates = [HeadAddress(ip, self.head_port, "tailnet") for _name, ip in peers]
        return await self._probe_all(candidates)

    async def _seeds(self) -> list[HeadAddress]:
        candidates = []
        for seed in self.seeds:
            host, _, port = seed.rpartition(":")
            if host and port.isdigit():
                candidates.append(HeadAddress(host, int(port), "seed"))
        return await self._probe_all(candidates)

    async def _probe_all(self, candidates: list[HeadAddress]) -> list[HeadAddress]:
        async def one(head: HeadAddress) -> HeadAddress | None:
            if self.role == "node":
                return head if await probe_node(head, psk=self.psk) is not None else None
            try:
                await probe_head(head, psk=self.psk, timeout_s=PROBE_TIMEOUT_S)
            except JoinRefused as exc:
                log.debug("no head of this fleet at %s: %s", head, exc)
                return None
            return head

        results = await asyncio.gather(*(one(h) for h in candidates))
        return [h for h in results if h is not None]
