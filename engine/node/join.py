"""A node that joins heads: it dials, keeps one connection per lane to each head, redials.

The node is the Noise initiator here; the head speaks first with its hello and
the node answers, then the connection serves generations exactly like one a
head dialed (NodeAgent.serve_link).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from dataclasses import dataclass

from engine.link import messages as m
from engine.link.connection import LinkError, LinkErrorKind
from engine.link.hello import WrongPeer, exchange_hellos
from engine.link.transport import LinkClosed, dial
from engine.node.agent import NodeAgent

log = logging.getLogger("shoal.node")

BACKOFF_MIN_S = 0.5
BACKOFF_MAX_S = 10.0


@dataclass(frozen=True, slots=True)
class HeadAddress:
    host: str
    port: int
    source: str = "given"  # given | lan | tailnet | seed | code

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def found(self) -> bool:
        """Found on the network (a claim until its handshake shows the token), not given
        by the user."""
        return self.source in ("lan", "tailnet")


class JoinRefused(Exception):
    """The head will not take this node; the message names the cause and the fix."""


def refusal_text(head: HeadAddress, exc: BaseException) -> str:
    if isinstance(exc, LinkError) and exc.kind in (LinkErrorKind.CLOSED_AT_HANDSHAKE,
                                                    LinkErrorKind.WRONG_TOKEN):
        return (f"the head at {head} refused this node's fleet token (another fleet, or a "
                "rotated token); pair again: `shoal fleet pair` on the head, then "
                "`shoal node join --code URL` here")
    if isinstance(exc, LinkError) and exc.kind is LinkErrorKind.NO_TOKEN_THERE:
        return (f"the head at {head} has no fleet token and this node has one; make the "
                "token on the head (`shoal fleet token`) and pair again")
    if isinstance(exc, LinkError) and exc.kind is LinkErrorKind.NO_TOKEN_HERE:
        return (f"the head at {head} uses a fleet token and this node has none; pair with "
                "`shoal node join --code URL` (from `shoal fleet pair` on the head)")
    if isinstance(exc, ConnectionRefusedError):
        return (f"nothing listens at {head}; start the head with --fleet-listen, or check "
                "the address")
    if isinstance(exc, TimeoutError):
        return f"the head at {head} did not answer in time; check the address and firewall"
    return f"cannot reach the head at {head}: {exc}"


async def probe_head(head: HeadAddress, *, psk: bytes | None,
                     timeout_s: float = 5.0) -> m.HeadHello:
    """Check the token against a head before any slow work; returns its hello."""
    try:
        link = await dial(head.host, head.port, psk=psk, timeout_s=timeout_s, found=head.found)
    except (OSError, TimeoutError, LinkError) as exc:
        raise JoinRefused(refusal_text(head, exc)) from None
    try:
        return await exchange_hellos(link, None, responder=False, expect=m.HeadHello,
                                     timeout_s=timeout_s)
    except WrongPeer:
        raise JoinRefused(f"{head} is not a Shoal head (it did not say hello as one)") from None
    except (TimeoutError, LinkClosed) as exc:
        raise JoinRefused(refusal_text(head, exc)) from None
    finally:
        link.close()


class Joiner:
    """Keeps ``lanes`` connections open to every head it is given."""

    def __init__(self, agent: NodeAgent, *, psk: bytes | None, handshake_timeout_s: float = 10.0,
                 rng: random.Random | None = None) -> None:
        self.agent = agent
        self.psk = psk
        self.handshake_timeout_s = handshake_timeout_s
        self._heads: dict[HeadAddress, list[asyncio.Task[None]]] = {}
        self._rng = rng or random.Random()
        self.linked: dict[HeadAddress, int] = {}  # open connections per head
        self.failures: dict[HeadAddress, int] = {}  # consecutive failed dials per head
        self.changed = asyncio.Event()

    @property
    def heads(self) -> list[HeadAddress]:
        return list(self._heads)

    def link(self, head: HeadAddress) -> None:
        if head in self._heads:
            return
        lanes = self.agent.lanes
        self._heads[head] = [
            asyncio.create_task(self._slot(head, i), name=f"join-{head}-{i}")
            for i in range(lanes)]
        self.linked.setdefault(head, 0)

    async def unlink(self, head: HeadAddress) -> None:
        tasks = self._heads.pop(head, [])
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.linked.pop(head, None)
        self.failures.pop(head, None)

    async def close(self) -> None:
        for head in list(self._heads):
            await self.unlink(head)

    async def _slot(self, head: HeadAddress, slot: int) -> None:
        delay = BACKOFF_MIN_S
        reported = False
        while True:
            try:
                link = await dial(head.host, head.port, psk=self.psk,
                                  timeout_s=self.handshake_timeout_s, found=head.found)
            except (OSError, TimeoutError, LinkError) as exc:
                self.failures[head] = self.failures.get(head, 0) + 1
                self.changed.set()
                if slot == 0 and not reported:
                    log.warning("%s; trying again", refusal_text(head, exc))
                    reported = True
                await asyncio.sleep(delay * (0.8 + 0.4 * self._rng.random()))
                delay = min(delay * 2, BACKOFF_MAX_S)
                continue
            delay = BACKOFF_MIN_S
            self.failures[head] = 0
            if slot == 0 and (reported or not self.linked.get(head)):
                log.info("linked with the head at %s (%s)", head, head.source)
            reported = False
            self.linked[head] = self.linked.get(head, 0) + 1
            self.changed.set()
            try:
                served = await self.agent.serve_link(link, responder=False)
            finally:
                self.linked[head] = max(0, self.linked.get(head, 1) - 1)
                self.changed.set()
                with contextlib.suppress(Exception):
                    link.close()
            if not served:  # this node refused the head (the agent said why): ask rarely
                await asyncio.sleep(BACKOFF_MAX_S * (0.8 + 0.4 * self._rng.random()))
                continue
            if slot == 0:
                log.info("the link with the head at %s dropped; dialing again", head)
            await asyncio.sleep(BACKOFF_MIN_S * self._rng.random())
