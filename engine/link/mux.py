"""Many sessions over one link: the channels of a link a head dialed.

Once both hellos agree (:attr:`engine.link.messages.HeadHello.channels`), the head
opens channels on the link (ids counting up from 1, never reused) and the node serves
each as it served a connection of its own: one generation at a time. What one step of
the loop sends on a link's channels leaves as one :class:`~engine.link.messages.Batch`:
one frame, one encryption and one write here, one read and one decryption there. A
batching engine yields a token for each of its lanes in one step, so a node's step
crosses as one record instead of one per lane (docs/decisions.md, "One link per node").

A channel opens at the peer with its first record (a ping, sent as it is opened, so
ids open in order); closing one tells the other end (``End``); the link ending ends
every channel. The head takes records in the link's read callback (:meth:`Mux.start`);
the node reads with :meth:`Mux.run`, which stops reading the link while a channel holds
too many records unread, so that a flooding peer waits in the kernel, not in memory here.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Callable

from engine.link import messages as m
from engine.link.transport import Link, LinkClosed, OnClosed, OnRecord

log = logging.getLogger("shoal.link")

MAX_CHANNELS = 1024  # open on one link at once; a head opens one per lane of the node
MAX_UNREAD = 256  # records a channel holds unread before its link's reading waits
_FLUSH_BYTES = 1 << 20  # a batch is sent at once past about this much (records are small)
CLOSED_HERE = "closed by this end"


def _weight(rec: m.ChannelRecord) -> int:
    """About how many bytes ``rec`` encodes to: keeps a batch far under MAX_RECORD."""
    if type(rec) is m.Generate:
        return 5 * (len(rec.prompt) + len(rec.stop_ids)) + 256
    if type(rec) is m.Error:
        return 4 * len(rec.message) + 32
    if type(rec) is m.End:
        return 4 * len(rec.reason) + 32
    return 32


class Mux:
    """The channels of one link. ``on_channel`` (the node's side) is called with each
    channel the peer opens; without it this end opens them (:meth:`open`)."""

    def __init__(self, link: Link, *, on_channel: Callable[[Channel], None] | None = None,
                 max_channels: int = MAX_CHANNELS) -> None:
        self.link = link
        self.peer = link.peer
        self.encrypted = link.encrypted
        self._on_channel = on_channel
        self._max = max_channels
        self._channels: dict[int, Channel] = {}
        self._next = 1  # the next id to open, or the lowest a new channel of the peer may have
        self._out: list[tuple[int, m.ChannelRecord]] = []
        self._out_bytes = 0
        self._flush_due = False
        self._full: Channel | None = None  # a channel over MAX_UNREAD (Mux.run waits for it)
        self._readable: asyncio.Future[None] | None = None
        self.ended: str | None = None  # why the link ended; None while it is open
        # the peer's first record, or the link's end: a node that refuses a head does so
        # before it serves any channel
        self.answered: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    @property
    def channels(self) -> int:
        return len(self._channels)

    # -- the two ways of reading -------------------------------------------------------

    def start(self) -> None:
        """Hand records to the channels from within the link's read callback (the head)."""
        self.link.deliver_to(self._on_record, self._on_link_closed)

    async def run(self, idle_timeout_s: float) -> None:
        """Read the link until it ends, or is silent for ``idle_timeout_s`` (the node).
        LinkClosed and TimeoutError end it quietly; the link is closed on the way out."""
        reason = "the peer closed the link"
        try:
            while True:
                async with asyncio.timeout(idle_timeout_s):
                    rec = await self.link.recv()
                self._on_record(rec)
                while self._full is not None and self.ended is None:
                    self._readable = asyncio.get_running_loop().create_future()
                    try:
                        await self._readable
                    finally:
                        self._readable = None
        except LinkClosed as exc:
            reason = f"connection lost: {exc}"
        except TimeoutError:
            reason = f"nothing heard for {idle_timeout_s:.0f} s"
            log.info("dropping a link from %s idle for %.0f s", self.peer, idle_timeout_s)
        finally:
            self.link.close()
            self._on_link_closed(reason)

    # -- channels ----------------------------------------------------------------------

    def open(self) -> Channel:
        if self.ended is not None:
            raise LinkClosed(self.ended)
        chan = Channel(self, self._next)
        self._next += 1
        self._channels[chan.id] = chan
        # a channel opens at the peer with its first record: one now, so that they open
        # there in the order of their ids (an id below the highest seen is one closed)
        self._send(chan.id, m.Ping(nonce=0))
        return chan

    def _on_record(self, rec: m.Record) -> None:
        if not self.answered.done():
            self.answered.set_result(None)
        if type(rec) is m.Error:  # the peer refuses this end as a whole (wrong_model)
            for refused in list(self._channels.values()):
                with contextlib.suppress(Exception):
                    refused._feed(rec)
            self.link.close()
            self._on_link_closed(f"refused: {rec.message}")
            return
        if type(rec) is not m.Batch:  # once channels are on, every record travels in one
            log.warning("closed the link with %s: it sent a %s outside a channel; check that "
                        "it runs the same Shoal version", self.peer, type(rec).__name__)
            self.link.abort()
            self._on_link_closed(f"a {type(rec).__name__} record outside a channel")
            return
        for ch, r in rec.items:
            chan = self._channels.get(ch)
            if chan is None:
                chan = self._incoming(ch, r)
                if chan is None:
                    continue
            if type(r) is m.End:
                del self._channels[ch]
                chan._end(r.reason, tell=False)
                continue
            try:
                chan._feed(r)
            except Exception:  # a receiver's bug: end its channel rather than leave it
                log.exception("closed a channel to %s: its receiver failed", self.peer)
                chan._end("the receiver of the channel's records failed", tell=True)

    def _incoming(self, ch: int, rec: m.ChannelRecord) -> Channel | None:
        """A record for a channel not open here: the peer opening one, or late records of
        one closed here (dropped)."""
        if self._on_channel is None or ch < self._next or type(rec) is m.End:
            return None
        self._next = ch + 1
        if len(self._channels) >= self._max:
            self._send(ch, m.End(reason=f"more than {self._max} channels on one link"))
            return None
        chan = Channel(self, ch)
        self._channels[ch] = chan
        self._on_channel(chan)
        return chan

    def _on_link_closed(self, reason: str) -> None:
        if self.ended is not None:
            return
        self.ended = reason
        if not self.answered.done():
            self.answered.set_result(None)
        self._out.clear()
        channels = list(self._channels.values())
        self._channels.clear()
        for chan in channels:
            chan._end(reason, tell=False)
        self._wake_reader()

    def _wake_reader(self) -> None:
        if self._readable is not None and not self._readable.done():
            self._readable.set_result(None)

    def _read_below(self, chan: Channel) -> None:
        if self._full is chan:
            self._full = None
            self._wake_reader()

    # -- sending -----------------------------------------------------------------------

    def _send(self, ch: int, rec: m.ChannelRecord) -> None:
        """Queue ``rec`` for the batch that leaves at the end of this step of the loop."""
        if self.ended is not None:
            raise LinkClosed(self.ended)
        self._out.append((ch, rec))
        self._out_bytes += _weight(rec)
        if self._out_bytes >= _FLUSH_BYTES or len(self._out) >= m.MAX_BATCH:
            self._flush()
        elif not self._flush_due:
            self._flush_due = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_due = False
        if not self._out:
            return
        items, self._out, self._out_bytes = self._out, [], 0
        with contextlib.suppress(LinkClosed):  # the link's end reaches every channel
            self.link.send(m.Batch(items=items))

    def close(self) -> None:
        self._flush()
        self.link.close()

    def abort(self) -> None:
        self.link.abort()
        self._on_link_closed("dropped by this end")


class Channel:
    """One channel: what a connection of its own was (``send``, ``recv`` or
    ``deliver_to``, ``drain``, ``close``), over its link's :class:`Mux`."""

    def __init__(self, mux: Mux, ident: int) -> None:
        self._mux = mux
        self.id = ident
        self.peer = mux.peer
        self.encrypted = mux.encrypted
        self._inbox: collections.deque[m.Record] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._push: tuple[OnRecord, OnClosed] | None = None
        self._replaying = False
        self._told = False
        self.ended: str | None = None

    @property
    def closed(self) -> bool:
        return self.ended is not None

    def send(self, record: m.ChannelRecord) -> None:
        if self.ended is not None:
            raise LinkClosed(self.ended)
        self._mux._send(self.id, record)

    async def drain(self) -> None:
        """Wait while the peer is slower than what the link sends (flow control)."""
        if self.ended is not None:
            raise LinkClosed(self.ended)
        await self._mux.link.drain()
        if self.ended is not None:
            raise LinkClosed(self.ended)

    async def recv(self) -> m.Record:
        """The next record; the records read before the channel ended come first."""
        if self._push is not None:
            raise RuntimeError("this channel's records are delivered to a callback")
        while not self._inbox:
            if self.ended is not None:
                raise LinkClosed(self.ended)
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        rec = self._inbox.popleft()
        if len(self._inbox) < MAX_UNREAD // 2:
            self._mux._read_below(self)
        return rec

    def deliver_to(self, on_record: OnRecord, on_closed: OnClosed) -> None:
        """As :meth:`engine.link.transport.Link.deliver_to`: the records already read
        first, soon after this returns; ``on_closed`` once, after the last record."""
        self._push = (on_record, on_closed)
        self._replaying = True
        asyncio.get_running_loop().call_soon(self._replay)

    def _replay(self) -> None:
        assert self._push is not None
        while self._inbox:
            self._push[0](self._inbox.popleft())
        self._replaying = False
        if self.ended is not None:
            self._tell_closed()

    def _feed(self, rec: m.Record) -> None:
        if self._push is not None and not self._replaying:
            self._push[0](rec)
            return
        self._inbox.append(rec)
        if len(self._inbox) > MAX_UNREAD and self._push is None:
            self._mux._full = self
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _end(self, reason: str, *, tell: bool) -> None:
        if self.ended is not None:
            return
        self.ended = reason
        if tell:
            self._mux._channels.pop(self.id, None)
            with contextlib.suppress(LinkClosed):
                self._mux._send(self.id, m.End(reason=reason[:4000]))
        self._mux._read_below(self)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
        if self._push is not None and not self._replaying:
            if tell:  # closed here: told soon, as a closed socket tells
                asyncio.get_running_loop().call_soon(self._tell_closed)
            else:
                self._tell_closed()

    def _tell_closed(self) -> None:
        if self._push is not None and not self._told:
            self._told = True
            self._push[1](self.ended or CLOSED_HERE)

    def close(self) -> None:
        self._end(CLOSED_HERE, tell=True)

    def abort(self) -> None:
        """Close at once (a fenced session, a node that broke its order): the same as
        :meth:`close`; the link and its other channels carry on."""
        self._end(CLOSED_HERE, tell=True)


Carrier = Link | Channel  # what a session runs over: a connection of its own, or a channel
