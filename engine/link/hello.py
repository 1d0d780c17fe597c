"""The hello exchange that opens every link, right after the handshake.

The Noise responder speaks first: it sends its hello (a node: identity, model,
window, lanes, rates; a head: the model it announces) and the initiator, once it
has checked who answered, sends its own. A probe (``mine=None``) only reads the
responder's hello and answers nothing.

Whatever goes wrong (no hello in time, the wrong kind of peer, the connection
lost) closes the link, so a caller never holds a link that did not say hello.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol, TypeVar, overload

from engine.link import messages as m
from engine.link.transport import LinkClosed

Hello = m.NodeHello | m.HeadHello
H = TypeVar("H", bound=Hello)
_KIND: dict[type, str] = {m.NodeHello: "node", m.HeadHello: "head"}


class HelloLink(Protocol):
    """What the exchange needs of a link (engine.link.transport.Link has it)."""

    def send(self, record: m.Record) -> None: ...

    async def recv(self) -> m.Record: ...

    def close(self) -> None: ...


class WrongPeer(LinkClosed):
    """The peer did not say hello as the expected kind of peer; the link is closed."""

    def __init__(self, message: str, got: m.Record) -> None:
        super().__init__(message)
        self.got = got


@overload
async def exchange_hellos(link: HelloLink, mine: Hello | None, *, responder: bool,
                          expect: type[H], timeout_s: float) -> H: ...


@overload
async def exchange_hellos(link: HelloLink, mine: Hello | None, *, responder: bool,
                          expect: tuple[type[m.NodeHello], type[m.HeadHello]],
                          timeout_s: float) -> Hello: ...


async def exchange_hellos(link: HelloLink, mine: Hello | None, *, responder: bool,
                          expect: type[Any] | tuple[type[Any], ...],
                          timeout_s: float) -> Hello:
    """Say hello in the order the roles require and return the peer's hello.

    ``responder``: this end accepted the connection, so it speaks first. ``expect``: the
    kind (or kinds) of hello the peer must send. Raises WrongPeer (a LinkClosed) when it
    sends something else, TimeoutError when it says nothing within ``timeout_s``,
    LinkClosed when the connection is lost; the link is closed in every case.
    """
    if responder and mine is None:
        raise ValueError("the responder speaks first: it needs a hello of its own")
    kinds = expect if isinstance(expect, tuple) else (expect,)
    try:
        if responder:
            assert mine is not None
            link.send(mine)
        async with asyncio.timeout(timeout_s):
            theirs = await link.recv()
        if not (isinstance(theirs, Hello) and type(theirs) in kinds):
            raise WrongPeer(_wrong(kinds, theirs), theirs)
        if not responder and mine is not None:
            link.send(mine)
    except BaseException:
        link.close()
        raise
    return theirs


def _wrong(kinds: tuple[type[Any], ...], got: m.Record) -> str:
    want = " or ".join(_KIND[k] for k in kinds)
    said = _KIND.get(type(got))
    how = f"it said hello as a {said}" if said else "it did not say hello"
    return f"the peer is not a Shoal {want} ({how})"
