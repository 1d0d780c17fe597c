"""Heads of one fleet keep their alias tables in step.

Heads meet over the same encrypted link nodes use: a head dials another
head's fleet listener and both say hello as heads. On meeting, and every
SYNC_S after, each sends its table and merges the other's, keeping the higher
version of each entry; a change made here is pushed at once, and the answer
to the push tells how many heads hold it. A head that was off serves the
table it saved and catches up at its first sync.

A table too large for a link record (tables that grew apart can pass the bound of
`engine.head.naming.aliases` together) is not sent: one line says so, the link stays,
and sync resumes once aliases are removed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from engine.head.naming import aliases as al
from engine.link import messages as m
from engine.link.connection import LinkError
from engine.link.hello import exchange_hellos
from engine.link.transport import Link, LinkClosed, dial
from engine.tasks import TaskSet, cancel_and_wait

log = logging.getLogger("shoal.head")

SYNC_S = 30.0
RETRY_S = 10.0
DROP_DISCOVERED_AFTER = 3  # failed dials in a row before a head found on the network is let go
PUSH_WAIT_S = 2.0
SYNC_LIMIT = m.MAX_RECORD - 1024  # the most an AliasSync's table may hold (messages.py)


@dataclass
class Peer:
    label: str  # address we dial, or the peer's head id for a peer that dialed us
    head_id: str = ""
    name: str = ""  # its machine's host name, as its hello says
    link: Link | None = None
    pending: dict[int, asyncio.Future[al.AliasTable]] = field(default_factory=dict)


class HeadPeers:
    def __init__(self, *, head_id: str, model: str, psk: bytes | None, listen_port: int,
                 table: Callable[[], al.AliasTable], on_merged: Callable[[list[str]], None],
                 handshake_timeout_s: float = 10.0, name: str = "",
                 clock: Callable[[], float] = time.time) -> None:
        """``clock``: wall-clock seconds, for the age of removals in a merge; ``name``:
        this machine's host name, told to the other heads."""
        self.head_id = head_id
        self.name = name
        self.model = model
        self.listen_port = listen_port
        self.psk = psk
        self._table = table
        self._on_merged = on_merged
        self.handshake_timeout_s = handshake_timeout_s
        self.peers: dict[str, Peer] = {}
        self._tasks = TaskSet("the links to other heads")
        self._serial = 0
        self._self_labels: set[str] = set()  # our own announcement, found on the network
        self._clock = clock
        self._too_large = False  # the table was too large to send, and said so

    # -- meeting -------------------------------------------------------------------

    def dial(self, host: str, port: int, *, discovered: bool = False) -> None:
        """Keep a link to the head at host:port (a seed, or one found on the network:
        ``discovered``, let go after repeated failed dials)."""
        label = f"{host}:{port}"
        if label in self.peers or label in self._self_labels:
            return
        self.peers[label] = Peer(label)
        self._tasks.spawn(self._dial_loop(label, host, port, discovered), f"peer-{label}")

    async def _dial_loop(self, label: str, host: str, port: int, discovered: bool) -> None:
        reported = False
        failures = 0
        while True:
            try:
                link = await dial(host, port, psk=self.psk, timeout_s=self.handshake_timeout_s,
                                  found=discovered)
                hello = await exchange_hellos(
                    link, m.HeadHello(head_id=self.head_id, model=self.model,
                                      listen_port=self.listen_port, name=self.name),
                    responder=False, expect=m.HeadHello, timeout_s=self.handshake_timeout_s)
            except (OSError, TimeoutError, LinkError, LinkClosed) as exc:
                failures += 1
                if discovered and failures >= DROP_DISCOVERED_AFTER:
                    log.info("forgetting head peer %s found on the network: %d dials failed "
                             "(%s)", label, failures, exc)
                    self.peers.pop(label, None)
                    return
                if not reported:
                    log.info("head peer %s unreachable (%s); retrying every %d s", label, exc,
                             int(RETRY_S))
                    reported = True
                await asyncio.sleep(RETRY_S)
                continue
            reported = False
            failures = 0
            if hello.head_id == self.head_id:
                link.close()  # found ourselves on the network
                self.peers.pop(label, None)
                self._self_labels.add(label)
                return
            await self.serve(link, hello.head_id, label=label, name=hello.name)
            await asyncio.sleep(RETRY_S / 10)

    def accepted(self, link: Link, hello: m.HeadHello) -> None:
        """A head dialed our fleet listener: known by where it listens, like a seed."""
        if hello.head_id == self.head_id:
            link.close()  # our own dial, after finding ourselves on the network
            return
        host = link.peer.rpartition(":")[0]
        label = f"{host}:{hello.listen_port}" if hello.listen_port else f"id:{hello.head_id}"
        self._tasks.spawn(self.serve(link, hello.head_id, label=label, name=hello.name),
                    f"peer-{hello.head_id}")

    # -- one link ------------------------------------------------------------------

    async def serve(self, link: Link, head_id: str, *, label: str, name: str = "") -> None:
        peer = self.peers.setdefault(label, Peer(label))
        peer.head_id, peer.name = head_id, name
        if any(p.head_id == head_id and p.link is not None and not p.link.closed
               for p in self.peers.values()):
            link.close()  # already linked the other way
            await asyncio.sleep(RETRY_S)
            return
        peer.link = link
        log.info("linked with head %s at %s; syncing aliases", head_id, link.peer)
        sync = asyncio.create_task(self._sync_every(peer), name=f"sync-{head_id}")
        try:
            while True:
                rec = await link.recv()
                if isinstance(rec, m.AliasSync):
                    self._on_sync(peer, rec)
                elif isinstance(rec, m.Ping):
                    link.send(m.Pong(nonce=rec.nonce))
        except LinkClosed:
            pass
        finally:
            await cancel_and_wait([sync], "a link to another head")
            peer.link = None
            for fut in peer.pending.values():
                if not fut.done():
                    fut.cancel()
            peer.pending.clear()
            link.close()

    def known(self) -> int:
        """Other heads this head knows of: by id once met, by address before."""
        return len({p.head_id or p.label for p in self.peers.values()})

    async def _sync_every(self, peer: Peer) -> None:
        while True:
            self._send(peer, reply=True)
            await asyncio.sleep(SYNC_S)

    def _send(self, peer: Peer, *, reply: bool, serial: int = 0) -> bool:
        """Send our table to ``peer``; False when it was not sent (no link, or a table
        too large for a record: said once, and the link is kept)."""
        if peer.link is None:
            return False
        table = self._table()
        size = table.sync_size()
        if size > SYNC_LIMIT:
            if not self._too_large:
                log.warning("the alias table (%d names, %d bytes) is too large to send to "
                            "the other heads (at most %d); they get no alias changes until "
                            "aliases are removed with `shoal alias rm NAME`", table.names,
                            size, SYNC_LIMIT)
                self._too_large = True
            return False
        self._too_large = False
        try:
            peer.link.send(m.AliasSync(table=table.sync_json(), reply=reply, serial=serial))
        except LinkClosed:
            return False
        except LinkError as exc:  # a record refused as we made it: the link is unharmed
            log.warning("could not send the alias table to head %s: %s", peer.head_id, exc)
            return False
        return True

    def _on_sync(self, peer: Peer, rec: m.AliasSync) -> None:
        try:
            theirs = al.AliasTable.from_json(rec.table, source=f"head {peer.head_id}")
        except al.AliasError as exc:
            log.warning("ignoring the alias table of head %s: %s", peer.head_id, exc)
            return
        table = self._table()
        now = self._clock()
        purged = table.purge(now)
        changed = table.merge(theirs.snapshot(), now=now)
        if changed:
            log.info("aliases from head %s: %s", peer.head_id, ", ".join(changed))
        if changed or purged:
            self._on_merged(sorted({*changed, *purged}))
        if rec.reply:
            self._send(peer, reply=False, serial=rec.serial)
        fut = peer.pending.pop(rec.serial, None) if rec.serial else None
        if fut is not None and not fut.done():
            fut.set_result(theirs)

    # -- spreading a change ----------------------------------------------------------

    async def spread(self, entries: Sequence[al.AliasEntry]) -> tuple[int, int]:
        """Push the table to every linked head, once for all of ``entries``: (heads
        holding every one of them, heads known)."""
        loop = asyncio.get_running_loop()
        waits: list[asyncio.Future[al.AliasTable]] = []
        for peer in self.peers.values():
            if peer.link is None:
                continue
            self._serial += 1
            fut: asyncio.Future[al.AliasTable] = loop.create_future()
            peer.pending[self._serial] = fut
            if self._send(peer, reply=True, serial=self._serial):
                waits.append(fut)
            else:
                del peer.pending[self._serial]
        held = 1
        if waits:
            done, _ = await asyncio.wait(waits, timeout=PUSH_WAIT_S)
            for fut in done:
                if not fut.cancelled() and fut.exception() is None \
                        and all(fut.result().holds(e.name, e.version) for e in entries):
                    held += 1
        return held, 1 + self.known()

    async def close(self) -> None:
        await self._tasks.close()
        for peer in self.peers.values():
            if peer.link is not None:
                peer.link.close()
