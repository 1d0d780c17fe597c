"""The head's listener for nodes that join (``--fleet-listen``).

The node dials, so it is the Noise initiator and the head the responder: the
head speaks first with its hello (the model it announces), the node answers
with its own, and the connection joins that node's pool like a dialed one.
"""

from __future__ import annotations

import asyncio
import logging
import socket

from engine.head.fleet.links import Fleet
from engine.head.fleet.peers import HeadPeers
from engine.link import messages as m
from engine.link.admission import FIRST_MESSAGE_S, PendingHandshakes
from engine.link.connection import LinkError, LinkErrorKind
from engine.link.hello import WrongPeer
from engine.link.listener import NotTaken, take
from engine.link.transport import Incoming, serve
from engine.tasks import TaskSet

log = logging.getLogger("shoal.head")


class JoinListener:
    def __init__(self, fleet: Fleet, *, handshake_timeout_s: float = 10.0,
                 peers: HeadPeers | None = None) -> None:
        self.fleet = fleet
        self.peers = peers  # takes heads that dial us to sync aliases
        self.handshake_timeout_s = handshake_timeout_s
        self.first_message_s = FIRST_MESSAGE_S  # a connection's first bytes (admission.py)
        self._server: asyncio.Server | None = None
        self._tasks = TaskSet("the join listener")
        self._warned: set[str] = set()
        self._pending: PendingHandshakes[Incoming] = PendingHandshakes()
        self.listen_port = 0

    async def listen_on(self, sock: socket.socket) -> None:
        self.listen_port = int(sock.getsockname()[1])
        self._server = await serve(self._on_accept, sock=sock)

    def _on_accept(self, incoming: Incoming) -> None:
        self._tasks.spawn(self._handle(incoming), "join")

    async def _handle(self, incoming: Incoming) -> None:
        where = incoming.peer
        if self.fleet.psk is None and not incoming.loopback:
            self._warn_once(incoming.peer_host or "?",
                            f"refused a node joining from {where}: a head with no fleet token "
                            "takes nodes from its own machine only; make one with "
                            "`shoal fleet token` and pair the node")
            incoming.close()
            return
        address = incoming.peer_host or "?"
        try:
            taken = await take(incoming, self._pending, address, psk=self.fleet.psk,
                               hello=self._hello, expect=(m.NodeHello, m.HeadHello),
                               handshake_timeout_s=self.handshake_timeout_s,
                               first_message_s=self.first_message_s)
        except NotTaken as exc:
            self._refused(where, address, exc.cause, handshaken=exc.handshaken,
                          bound=exc.bound)
            return
        if taken is None:
            return  # not a peer of this fleet, or gone: the link is closed
        link, hello = taken
        if isinstance(hello, m.NodeHello):
            self.fleet.add_joined(hello, link)
        elif self.peers is not None:
            self.peers.accepted(link, hello)
        else:
            link.close()  # a head, and this one does not sync with other heads

    def _hello(self) -> m.HeadHello:
        return m.HeadHello(head_id=self.fleet.head_id, model=self.fleet.model,
                           listen_port=self.listen_port, probe=self.fleet.probe,
                           progress=True, name=self.fleet.name)

    def _refused(self, where: str, address: str, exc: Exception, *, handshaken: bool,
                 bound: float) -> None:
        """Say once per address and cause why a connection was not taken."""
        if isinstance(exc, LinkError):
            fix = {LinkErrorKind.REPLAYED: "it was not answered",
                   LinkErrorKind.OLD_PEER: "update Shoal there"}.get(
                exc.kind, "pair it again (`shoal fleet pair` here, `shoal node join --code` "
                "there)")
            self._warn_once(f"{address}:{exc.kind.name}",
                            f"refused a node joining from {where}: {exc}; {fix}")
        elif isinstance(exc, WrongPeer):
            if isinstance(exc.got, m.Error) and exc.got.code == "wrong_model":
                self._warn_once(f"{where.rsplit(':', 1)[0]}:wrong_model",
                                f"the node joining from {where} refused this head: "
                                f"{exc.got.message}")
        elif handshaken:
            self._warn_once(f"{address}:silent",
                            f"a connection from {where} finished the handshake but sent "
                            f"no hello in {bound:.0f} s, so it has not shown the fleet "
                            "token (a copied handshake, or a peer of another Shoal "
                            "version); closed it")

    def _warn_once(self, host: str, message: str) -> None:
        if len(self._warned) > 1024:  # bounded: a scan must not grow it forever
            self._warned.clear()
        if host not in self._warned:
            self._warned.add(host)
            log.warning("%s", message)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        await self._tasks.close()
