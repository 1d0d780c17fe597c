"""Taking a connection on a listener: the handshake, then the hellos, under one deadline.

A head that takes joins (head/fleet/joins.py) and a node that takes heads
(node/agent.py) take a connection the same way, and the way is what keeps a stranger
out: the connection counts among the pending ones of its address until the peer's hello
shows that it holds the token (a completed handshake does not: admission.py), the
handshake and the hellos share one deadline no longer than ``PRE_HELLO_S``, and a link
that did not say hello is closed, never handed on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar, overload

from engine.link import messages as m
from engine.link.admission import PRE_HELLO_S, PendingHandshakes
from engine.link.connection import LinkError
from engine.link.hello import Hello, WrongPeer, exchange_hellos
from engine.link.transport import Incoming, Link, LinkClosed, accept

H = TypeVar("H", bound=Hello)


class NotTaken(Exception):
    """A connection refused at the door: ``cause`` is the LinkError, WrongPeer or
    TimeoutError, ``handshaken`` whether its handshake completed (a peer that then sent
    no hello), ``bound`` the seconds it was given. The connection is closed."""

    def __init__(self, cause: Exception, *, handshaken: bool, bound: float) -> None:
        super().__init__(str(cause))
        self.cause = cause
        self.handshaken = handshaken
        self.bound = bound


@overload
async def take(incoming: Incoming, pending: PendingHandshakes[Incoming], address: str, *,
               psk: bytes | None, hello: Callable[[], Hello], expect: type[H],
               handshake_timeout_s: float, first_message_s: float) -> tuple[Link, H] | None: ...


@overload
async def take(incoming: Incoming, pending: PendingHandshakes[Incoming], address: str, *,
               psk: bytes | None, hello: Callable[[], Hello],
               expect: tuple[type[m.NodeHello], type[m.HeadHello]],
               handshake_timeout_s: float,
               first_message_s: float) -> tuple[Link, Hello] | None: ...


async def take(incoming: Incoming, pending: PendingHandshakes[Incoming], address: str, *,
               psk: bytes | None, hello: Callable[[], Hello], expect: Any,
               handshake_timeout_s: float, first_message_s: float) -> tuple[Link, Hello] | None:
    """Accept ``incoming`` as the Noise responder and exchange hellos (ours, made by
    ``hello``, first); the link and the peer's hello, of a kind in ``expect``.

    Raises NotTaken when the peer failed (say why once per address, as the caller
    likes). None when the connection is gone through no fault to report: pushed out
    for a newer one from its address, lost, or not a peer of this fleet."""
    for older in pending.admit(incoming, address):
        older.push_out()  # a flood of connections that have not shown the token
    link: Link | None = None
    bound = min(handshake_timeout_s, PRE_HELLO_S)
    try:
        try:
            async with asyncio.timeout(bound):
                link = await accept(incoming, psk=psk, timeout_s=bound,
                                    first_message_s=min(bound, first_message_s))
                theirs = await exchange_hellos(link, hello(), responder=True, expect=expect,
                                               timeout_s=bound)
        finally:
            pending.release(incoming)
    except (LinkError, WrongPeer, TimeoutError) as exc:
        if incoming.pushed_out:  # closed here for a newer connection: no peer fault
            return None
        raise NotTaken(exc, handshaken=link is not None, bound=bound) from None
    except (OSError, LinkClosed):
        return None
    return link, theirs
