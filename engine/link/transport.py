"""The asyncio adapter around LinkConnection: the only link code that touches a socket.

Each link's socket has one :class:`_Socket` protocol, which puts the bytes the kernel
hands over straight into the link's LinkConnection. A link is read in one of two ways:

* ``await link.recv()``: the next record (the handshake, the hellos, and a node, which
  reads little: generations, renewals, pings);
* :meth:`Link.deliver_to`: from then on every record goes to a callback from within the
  transport's read callback, as soon as it is read. The head reads its nodes so, once
  per token: a token reaches the HTTP side without a reader task to wake in between.

Buffers are bounded: a link read with ``recv`` stops reading the socket once
``_READ_LIMIT`` bytes wait unparsed (what the peer sends then waits in the kernel), and
LinkConnection checks every length before it buffers for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import time
from collections.abc import Callable

from engine.link import messages
from engine.link.connection import (
    NEED_DATA,
    Closed,
    Event,
    HandshakeDone,
    LinkConnection,
    LinkError,
    LinkErrorKind,
    NeedData,
    State,
)
from engine.link.found import FoundAddresses
from engine.link.replay import ReplayGuard, Verdict, explain

_READ_LIMIT = 1 << 16
_EARLY_LIMIT = 1 << 12  # bytes a connection may send before its handshake is looked at
log = logging.getLogger("shoal.link")
# the first handshake messages this process took, whichever listener took them: a copy
# is refused at the node's listener and the head's alike
_REPLAYS = ReplayGuard()
# the addresses found on the network that this process dialed, and how they answered
_FOUND = FoundAddresses()


class LinkClosed(Exception):
    """The peer went away (EOF, reset, or a broken frame)."""


OnRecord = Callable[[messages.Record], None]
OnClosed = Callable[[str], None]


class _Socket(asyncio.Protocol):
    """One link's connection: bytes in to the LinkConnection, flow control out."""

    def __init__(self, on_connect: Callable[[_Socket], None] | None = None) -> None:
        self._on_connect = on_connect
        self.transport: asyncio.Transport | None = None
        self.conn: LinkConnection | None = None
        self._early = bytearray()  # what came before a LinkConnection was attached
        self.lost: str | None = None  # why the connection ended; None while it is open
        self._data: asyncio.Future[None] | None = None  # recv waiting for bytes
        self._writable: asyncio.Future[None] | None = None  # drain waiting for the kernel
        self._write_paused = False
        self._read_paused = False
        self._push: tuple[OnRecord, OnClosed] | None = None
        self._told_closed = False
        self.peer = "?"
        self.peer_host = ""
        self.received = 0  # bytes read so far

    # -- asyncio.Protocol --------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        name = transport.get_extra_info("peername")
        if name:
            self.peer_host = str(name[0])
            self.peer = f"{name[0]}:{name[1]}"
        if self._on_connect is not None:
            self._on_connect(self)

    def data_received(self, data: bytes) -> None:
        self.received += len(data)
        conn = self.conn
        if conn is None:
            self._early += data
            if len(self._early) > _EARLY_LIMIT:
                self._pause_reading()
        else:
            conn.receive_data(data)
            if self._push is not None:
                self._pump()
                return
            if conn.buffered > _READ_LIMIT:
                self._pause_reading()
        self._wake_data()

    def eof_received(self) -> bool:
        if self.conn is not None:
            self.conn.receive_data(b"")
            if self._push is not None:
                self._pump()
        self._wake_data()
        return False  # the transport closes; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = str(exc) if exc is not None else "the peer closed the connection"
        self._wake_data()
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)
        if self._push is not None:
            self._pump_or_close()  # whatever was read before the end, then the end

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    # -- reading ---------------------------------------------------------------------

    def attach(self, conn: LinkConnection) -> None:
        self.conn = conn
        if self._early:
            conn.receive_data(bytes(self._early))
            self._early.clear()
        self._resume_reading()

    async def wait_data(self) -> None:
        """Until more bytes (or the end) arrive."""
        if self.lost is not None:
            return
        self._resume_reading()
        self._data = asyncio.get_running_loop().create_future()
        try:
            await self._data
        finally:
            self._data = None

    def _wake_data(self) -> None:
        if self._data is not None and not self._data.done():
            self._data.set_result(None)

    def _pause_reading(self) -> None:
        if not self._read_paused and self.transport is not None:
            self._read_paused = True
            with contextlib.suppress(RuntimeError):
                self.transport.pause_reading()

    def _resume_reading(self) -> None:
        if self._read_paused and self.transport is not None:
            self._read_paused = False
            with contextlib.suppress(RuntimeError):
                self.transport.resume_reading()

    def push_to(self, on_record: OnRecord, on_closed: OnClosed) -> None:
        self._push = (on_record, on_closed)
        self._resume_reading()
        asyncio.get_running_loop().call_soon(self._pump_or_close)

    def _pump_or_close(self) -> None:
        self._pump()
        if self.lost is not None:
            self._closed(f"connection lost: {self.lost}")

    def next_event(self) -> Event | NeedData:
        """The LinkConnection's next event; a peer that broke the protocol is told in the
        log once, here, and its link closed (LinkClosed)."""
        assert self.conn is not None
        try:
            return self.conn.next_event()
        except LinkError as exc:
            log.warning("closed the link with %s: %s; check that it runs the same "
                        "Shoal version", self.peer, exc)
            self.close()
            raise LinkClosed(str(exc)) from exc

    def _pump(self) -> None:
        """Hand every whole record read so far to the receiver."""
        assert self._push is not None
        on_record = self._push[0]
        while not self._told_closed:
            try:
                event = self.next_event()
            except LinkClosed as exc:
                self._closed(str(exc))
                return
            if event is NEED_DATA:
                return
            if isinstance(event, Closed):
                self.close()
                self._closed("the peer closed the connection")
                return
            if isinstance(event, HandshakeDone | NeedData):
                continue
            try:
                on_record(event)
            except Exception:  # a receiver's bug: drop the link rather than leave it
                log.exception("dropped the link with %s: its receiver failed", self.peer)
                self.abort()
                self._closed("the receiver of the link's records failed")
                return

    def _closed(self, reason: str) -> None:
        if self._push is not None and not self._told_closed:
            self._told_closed = True
            self._push[1](reason)

    # -- writing ---------------------------------------------------------------------

    @property
    def closing(self) -> bool:
        return self.transport is None or self.transport.is_closing()

    def write(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(data)

    async def drain(self) -> None:
        """Until the kernel takes more (only while the transport's buffer is over its
        high-water mark); LinkClosed when the connection is gone."""
        if self.lost is not None:
            raise LinkClosed(f"connection lost: {self.lost}")
        if not self._write_paused:
            return
        self._writable = asyncio.get_running_loop().create_future()
        try:
            await self._writable
        finally:
            self._writable = None
        if self.lost is not None:
            raise LinkClosed(f"connection lost: {self.lost}")

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()


class Link:
    """An open link: ``send`` records, ``await recv()`` the next one (or have them
    delivered: :meth:`deliver_to`)."""

    def __init__(self, conn: LinkConnection, sock: _Socket, peer: str) -> None:
        self._conn = conn
        self._sock = sock
        self.peer = peer
        self.encrypted = conn.encrypted

    async def recv(self) -> messages.Record:
        if self._sock._push is not None:
            raise RuntimeError("this link's records are delivered to a callback")
        while True:
            event = self._sock.next_event()
            if event is NEED_DATA:
                if self._sock.lost is not None:
                    self.close()
                    raise LinkClosed(f"connection lost: {self._sock.lost}")
                await self._sock.wait_data()
                continue
            if isinstance(event, Closed):
                self.close()
                raise LinkClosed("the peer closed the connection")
            if isinstance(event, HandshakeDone):  # cannot happen once open
                continue
            assert not isinstance(event, NeedData)
            return event

    def deliver_to(self, on_record: OnRecord, on_closed: OnClosed) -> None:
        """From now on call ``on_record`` with every record as it is read (the records
        already read first, soon after this returns), and ``on_closed`` once with why
        the link ended. ``recv`` may not be used after this."""
        self._sock.push_to(on_record, on_closed)

    def send(self, record: messages.Record) -> None:
        if self._sock.closing:
            raise LinkClosed("the connection is closed")
        self._sock.write(self._conn.send(record))

    async def drain(self) -> None:
        """Wait while the peer is slower than what is sent (flow control)."""
        await self._sock.drain()

    @property
    def closed(self) -> bool:
        return self._sock.closing

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._sock.close()

    def abort(self) -> None:
        """Drop at once, without a clean close (a fenced or hung peer)."""
        with contextlib.suppress(Exception):
            self._sock.abort()


class Incoming:
    """A connection accepted by :func:`serve`, before its handshake (see :func:`accept`)."""

    def __init__(self, sock: _Socket) -> None:
        self._sock = sock
        self.pushed_out = False  # closed here for a newer one (admission.py): no peer fault

    @property
    def peer(self) -> str:
        """host:port of the peer."""
        return self._sock.peer

    @property
    def peer_host(self) -> str:
        return self._sock.peer_host

    @property
    def loopback(self) -> bool:
        return is_loopback(self._sock.peer_host)

    def close(self) -> None:
        self._sock.close()

    def push_out(self) -> None:
        """Close it to make way for a newer connection; its handshake then fails with
        nothing to say about the peer."""
        self.pushed_out = True
        self._sock.close()


async def serve(on_incoming: Callable[[Incoming], None], host: str | None = None,
                port: int = 0, *, sock: socket.socket | None = None) -> asyncio.Server:
    """Listen for links; ``on_incoming`` gets each new connection (it should start a
    task that calls :func:`accept`, or close it)."""
    loop = asyncio.get_running_loop()

    def protocol() -> _Socket:
        return _Socket(on_connect=lambda s: on_incoming(Incoming(s)))

    if sock is not None:
        return await loop.create_server(protocol, sock=sock)
    return await loop.create_server(protocol, host, port)


async def _handshake(conn: LinkConnection, sock: _Socket, replay: ReplayGuard) -> None:
    while True:
        event = conn.next_event()
        if event is NEED_DATA:
            if sock.lost is not None:
                conn.receive_data(b"")  # the end, for the LinkConnection to judge
                continue
            await sock.wait_data()
            continue
        if isinstance(event, HandshakeDone):
            if event.sent_at is not None:  # a responder judges the dialer's first message
                now = time.time()
                verdict = replay.check(event.peer_key, event.sent_at, now)
                if verdict is not Verdict.FRESH:
                    raise LinkError(LinkErrorKind.REPLAYED,
                                    explain(verdict, event.sent_at, now))
            reply = conn.handshake_reply()
            if reply:
                sock.write(reply)
                await sock.drain()
            return
        raise LinkError(LinkErrorKind.PROTOCOL, "the peer spoke before the handshake ended")


async def dial(host: str, port: int, *, psk: bytes | None, timeout_s: float = 10.0,
               found: bool = False) -> Link:
    """Connect and complete the handshake as the initiator.

    ``found``: the address came from the network (mDNS, the tailnet), not from the user;
    until it answers a handshake, dials to it go one at a time and back off after a failed
    one (:mod:`engine.link.found`), and a dial held back fails at once with LinkError
    BACKING_OFF, sending nothing.

    Raises OSError (cannot connect), TimeoutError, or LinkError (refused at the handshake,
    or refused here: without a token a link never leaves this machine, since prompts
    would cross the network in clear).
    """
    if psk is None and not is_loopback(host):
        raise LinkError(LinkErrorKind.PLAINTEXT_OFF_LOOPBACK,
                        f"refusing to dial {host}:{port} without a fleet token: a link "
                        "without one would carry prompts in clear; make the token with "
                        "`shoal fleet token` and pair the machines (`shoal fleet pair`)")
    address = f"{host}:{port}"
    if found:
        wait = _FOUND.wait_s(address, time.monotonic())
        if wait > 0:
            raise LinkError(LinkErrorKind.BACKING_OFF,
                            f"{address}, found on the network, has not shown this fleet's "
                            f"token ({_FOUND.failures(address)} failed handshakes); trying "
                            f"it again in {wait:.0f} s")
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(timeout_s):
            _, sock = await loop.create_connection(_Socket, host, port)
    except BaseException:
        if found:
            _FOUND.ended(address)  # nothing went out
        raise
    try:
        link = await _open(sock, LinkConnection(initiator=True, psk=psk), timeout_s, address,
                           _REPLAYS)
    except BaseException as exc:
        if found:  # the first message went out: a fake peer may keep it
            if isinstance(exc, Exception):
                _FOUND.failed(address, time.monotonic())
            else:
                _FOUND.ended(address)  # cancelled: no verdict on the peer
        raise
    if found:
        _FOUND.proven(address)
    return link


async def accept(incoming: Incoming, *, psk: bytes | None, timeout_s: float = 10.0,
                 first_message_s: float | None = None,
                 replay: ReplayGuard = _REPLAYS) -> Link:
    """Complete the handshake as the responder on an accepted connection, within
    ``timeout_s``, its first bytes within ``first_message_s`` (a connection that stays
    silent is a stranger's, not a dialer's). A first message that ``replay`` (by default,
    this process's) refuses fails with LinkError REPLAYED, before any answer: a copy of a
    message is never answered.

    A completed handshake does not show that the dialer holds the token (a copy of its
    first message completes it too): its first record, read with the transport keys,
    does."""
    sock = incoming._sock
    if first_message_s is not None:
        try:
            async with asyncio.timeout(first_message_s):
                while not sock.received and sock.lost is None:
                    await sock.wait_data()
        except BaseException:
            sock.close()
            raise
    return await _open(sock, LinkConnection(initiator=False, psk=psk), timeout_s, sock.peer,
                       replay)


async def _open(sock: _Socket, conn: LinkConnection, timeout_s: float, peer: str,
                replay: ReplayGuard) -> Link:
    """The handshake on ``sock`` (the dialer speaks first), within ``timeout_s``; the
    connection is closed when it fails (a connection lost in it is an OSError)."""
    sock.attach(conn)
    try:
        async with asyncio.timeout(timeout_s):
            if conn.initiator:
                sock.write(conn.initiate(time.time()))
                await sock.drain()
            if conn.state is State.HANDSHAKE:  # a plaintext dialer is open at once
                await _handshake(conn, sock, replay)
    except LinkClosed as exc:
        sock.close()
        raise OSError(str(exc)) from exc
    except BaseException:
        sock.close()
        raise
    return Link(conn, sock, peer)


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
