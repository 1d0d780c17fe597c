"""This machine's node as a member of a fleet: it links with every head of the fleet it
finds (or the one it was given), keeps one connection per lane to each, and looks for
heads again every minute, and at once when every head it knows stopped answering (a
head that moved is found at its new address).
"""

from __future__ import annotations

import asyncio
import logging

from engine.credentials.codes import JoinCode
from engine.discovery.service import HeadFinder
from engine.errors import JoinError
from engine.link import messages as m
from engine.node.agent import NodeAgent
from engine.node.join import HeadAddress, Joiner, JoinRefused, probe_head
from engine.roles.sockets import parse_address
from engine.settings import DiscoverySettings
from engine.tasks import cancel_and_wait

log = logging.getLogger("shoal.node")

REDISCOVER_S = 60.0
LOST_CHECK_S = 5.0  # how often a member checks whether every head stopped answering
LOST_AFTER = 3  # failed dials in a row before a head counts as gone
FIRST_LOOK_S = 5.0


async def locate(given: HeadAddress | None, *, psk: bytes | None,
                 discovery: DiscoverySettings, head_port: int
                 ) -> tuple[list[HeadAddress], m.HeadHello, HeadFinder]:
    """The heads to join, checked against the token before any slow work: (heads, the
    hello of the first that accepted this token, the finder to keep looking with)."""
    finder = HeadFinder(discovery.mode if given is None else "none", psk=psk,
                        seeds=list(discovery.seeds), tailscale_socket=discovery.tailscale_socket,
                        head_port=head_port)
    await finder.start()
    try:
        heads = [given] if given is not None else await finder.find(timeout_s=FIRST_LOOK_S)
        if not heads:
            raise JoinError(f"no head of this fleet found ({finder.where_looked()}); start "
                            "one with `shoal serve --fleet-listen`, or give its HOST:PORT",
                            code="no_head_found")
        problems = []
        for head in heads:
            try:
                return heads, await probe_head(head, psk=psk), finder
            except JoinRefused as exc:
                problems.append(str(exc))
        raise JoinError(problems[0], code="join_refused")
    except BaseException:
        await finder.close()
        raise


class Membership:
    def __init__(self, agent: NodeAgent, joiner: Joiner, finder: HeadFinder, *,
                 given: HeadAddress | None) -> None:
        self.agent = agent
        self.joiner = joiner
        self.finder = finder
        self.given = given
        self._task: asyncio.Task[None] | None = None

    @classmethod
    def start(cls, agent: NodeAgent, heads: list[HeadAddress], finder: HeadFinder, *,
              psk: bytes | None, given: HeadAddress | None,
              handshake_timeout_s: float) -> Membership:
        joiner = Joiner(agent, psk=psk, handshake_timeout_s=handshake_timeout_s)
        for head in heads:
            joiner.link(head)
        member = cls(agent, joiner, finder, given=given)
        if given is None:
            member._task = asyncio.create_task(member._keep_looking(), name="membership")
        return member

    @property
    def heads(self) -> list[HeadAddress]:
        return self.joiner.heads

    def linked(self) -> tuple[str, ...]:
        """The heads this node has a live connection to now."""
        return tuple(str(h) for h, n in self.joiner.linked.items() if n > 0)

    async def _keep_looking(self) -> None:
        loop = asyncio.get_running_loop()
        next_look = loop.time() + REDISCOVER_S
        joiner = self.joiner
        while True:
            await asyncio.sleep(LOST_CHECK_S)
            lost = all(joiner.failures.get(h, 0) >= LOST_AFTER for h in joiner.heads)
            if not lost and loop.time() < next_look:
                continue
            next_look = loop.time() + REDISCOVER_S
            found = await self.finder.find(timeout_s=3.0)
            for head in found:
                if head not in joiner.heads:
                    log.info("found the head at %s (%s)", head, head.source)
                    joiner.link(head)
            for head in joiner.heads:
                if joiner.failures.get(head, 0) >= LOST_AFTER and head not in found:
                    log.info("the head at %s is gone; forgetting it", head)
                    await joiner.unlink(head)

    def set_psk(self, psk: bytes | None) -> None:
        self.joiner.psk = psk

    def relink(self, agent: NodeAgent, heads: list[HeadAddress]) -> None:
        """Link ``heads`` again from a new node's ``agent`` (a model swapped in: the old
        node's links closed with it)."""
        self.agent = self.joiner.agent = agent
        for head in heads:
            self.joiner.link(head)

    async def close(self) -> None:
        await cancel_and_wait([self._task], "the fleet membership")
        await self.joiner.close()
        await self.finder.close()


def head_to_join(code: JoinCode | None, head: str | None, port: int) -> HeadAddress | None:
    """Where the head to join is: the code's, else ``head`` (HOST[:PORT]), else None."""
    if code is not None:
        return HeadAddress(code.head_host, code.head_port, "code")
    if head:
        return HeadAddress(*parse_address(head, port, what="the head"), "given")
    return None
