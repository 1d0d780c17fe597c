"""The asyncio adapter around LinkConnection: the only link code that awaits a socket."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket

from engine.link import messages
from engine.link.connection import (
    NEED_DATA,
    Closed,
    HandshakeDone,
    LinkConnection,
    LinkError,
    LinkErrorKind,
    NeedData,
)

_READ = 1 << 16
log = logging.getLogger("shoal.link")


class LinkClosed(Exception):
    """The peer went away (EOF, reset, or a broken frame)."""


class Link:
    """An open link: ``send`` records, ``await recv()`` the next one."""

    def __init__(self, conn: LinkConnection, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter, peer: str) -> None:
        self._conn = conn
        self._reader = reader
        self._writer = writer
        self.peer = peer
        self.encrypted = conn.encrypted

    async def recv(self) -> messages.Record:
        while True:
            try:
                event = self._conn.next_event()
            except LinkError as exc:
                # the peer broke the protocol: say so once here, whichever task reads
                log.warning("closed the link with %s: %s; check that it runs the same "
                            "Shoal version", self.peer, exc)
                self.close()
                raise LinkClosed(str(exc)) from exc
            if event is NEED_DATA:
                try:
                    data = await self._reader.read(_READ)
                except (ConnectionError, OSError) as exc:
                    self.close()
                    raise LinkClosed(f"connection lost: {exc}") from exc
                self._conn.receive_data(data)
                continue
            if isinstance(event, Closed):
                self.close()
                raise LinkClosed("the peer closed the connection")
            if isinstance(event, HandshakeDone):  # cannot happen once open
                continue
            assert not isinstance(event, NeedData)
            return event

    def send(self, record: messages.Record) -> None:
        if self._writer.is_closing():
            raise LinkClosed("the connection is closed")
        self._writer.write(self._conn.send(record))

    async def drain(self) -> None:
        try:
            await self._writer.drain()
        except (ConnectionError, OSError) as exc:
            self.close()
            raise LinkClosed(f"connection lost: {exc}") from exc

    @property
    def closed(self) -> bool:
        return self._writer.is_closing()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._writer.close()

    def abort(self) -> None:
        """Drop at once, without a clean close (a fenced or hung peer)."""
        transport = self._writer.transport
        with contextlib.suppress(Exception):
            transport.abort()


def _tune(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def _handshake(conn: LinkConnection, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> None:
    while True:
        event = conn.next_event()
        if event is NEED_DATA:
            data = await reader.read(_READ)
            conn.receive_data(data)
            continue
        if isinstance(event, HandshakeDone):
            reply = conn.handshake_reply()
            if reply:
                writer.write(reply)
                await writer.drain()
            return
        raise LinkError(LinkErrorKind.PROTOCOL, "the peer spoke before the handshake ended")


async def dial(host: str, port: int, *, psk: bytes | None, timeout_s: float = 10.0) -> Link:
    """Connect and complete the handshake as the initiator.

    Raises OSError (cannot connect), TimeoutError, or LinkError (refused at the handshake,
    or refused here: without a token a link never leaves this machine, since prompts
    would cross the network in clear).
    """
    if psk is None and not is_loopback(host):
        raise LinkError(LinkErrorKind.PLAINTEXT_OFF_LOOPBACK,
                        f"refusing to dial {host}:{port} without a fleet token: a link "
                        "without one would carry prompts in clear; make the token with "
                        "`shoal fleet token` and pair the machines (`shoal fleet pair`)")
    async with asyncio.timeout(timeout_s):
        reader, writer = await asyncio.open_connection(host, port, limit=_READ)
    _tune(writer)
    conn = LinkConnection(initiator=True, psk=psk)
    try:
        async with asyncio.timeout(timeout_s):
            writer.write(conn.initiate())
            await writer.drain()
            if conn.encrypted:
                await _handshake(conn, reader, writer)
    except BaseException:
        writer.close()
        raise
    return Link(conn, reader, writer, f"{host}:{port}")


async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *,
                 psk: bytes | None, timeout_s: float = 10.0) -> Link:
    """Complete the handshake as the responder on an accepted connection."""
    _tune(writer)
    peername = writer.get_extra_info("peername")
    peer = f"{peername[0]}:{peername[1]}" if peername else "?"
    conn = LinkConnection(initiator=False, psk=psk)
    try:
        async with asyncio.timeout(timeout_s):
            await _handshake(conn, reader, writer)
    except BaseException:
        writer.close()
        raise
    return Link(conn, reader, writer, peer)


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def peer_is_loopback(writer: asyncio.StreamWriter) -> bool:
    peername = writer.get_extra_info("peername")
    return bool(peername) and is_loopback(str(peername[0]))
