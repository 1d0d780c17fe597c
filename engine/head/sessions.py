"""Running a session on the fleet: queue, placement, streaming, failover.

A session is placed whole on one node. If that node fails (its connection
closes, or it goes silent: no tokens and no pong for STALL_S), the tokens
already delivered become part of the prompt and the session is placed again on
the next capable node, asking only for what is left. Token indices from the
node let the head check that nothing arrives twice or goes missing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict, deque
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from engine.head.fleet import ConnClosed, Fleet, Inbound, NodeConn, NodePool
from engine.head.placement import Placement, PlacementRequest, Policy, Refusal, place
from engine.link import messages as m
from engine.link.transport import LinkClosed

log = logging.getLogger("shoal.head")

# A node that sends nothing (no token, no pong) for this long while it holds a
# session counts as hung; the head pings it every PING_S of silence first.
STALL_S = 3.0
PING_S = 1.0
LEASE_MS = 10_000
MAX_WALL_S = 600.0
QUEUE_TIMEOUT_S = 20.0
_AFFINITY_MAX = 10_000


class PlacementError(Exception):
    """The session cannot run; ``status`` and ``code`` say how the API answers."""

    def __init__(self, status: int, code: str, message: str,
                 retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.retry_after = retry_after


@dataclass(frozen=True, slots=True)
class Job:
    session: str  # unique per request: names the generation on the link
    model: str
    prompt: list[int]
    max_tokens: int
    sampling: m.SamplingParams = field(default_factory=m.SamplingParams)
    stop_ids: list[int] = field(default_factory=list)
    affinity: str | None = None  # X-Session-Id / X-Session-Affinity
    pin_host: str | None = None
    prefer: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Finish:
    reason: str  # stop | length
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    node: str
    moves: int


class FifoGate:
    """Waiters for a free lane, served strictly in arrival order."""

    def __init__(self) -> None:
        self._waiters: deque[asyncio.Future[None]] = deque()

    def __len__(self) -> int:
        return len(self._waiters)

    def notify(self) -> None:
        for fut in self._waiters:
            if not fut.done():
                fut.set_result(None)
            return

    def enqueue(self) -> asyncio.Future[None]:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        return fut

    def is_first(self, fut: asyncio.Future[None]) -> bool:
        return bool(self._waiters) and self._waiters[0] is fut

    def rearm(self, fut: asyncio.Future[None]) -> asyncio.Future[None]:
        """Keep this waiter's place with a fresh future."""
        new: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        for i, f in enumerate(self._waiters):
            if f is fut:
                self._waiters[i] = new
                break
        return new

    def leave(self, fut: asyncio.Future[None]) -> None:
        with contextlib.suppress(ValueError):
            self._waiters.remove(fut)
        self.notify()


class SessionRunner:
    def __init__(self, fleet: Fleet, *, policy: Policy = "load-aware", pool_high: float = 90.0,
                 queue_timeout_s: float = QUEUE_TIMEOUT_S, stall_s: float = STALL_S,
                 lease_ms: int = LEASE_MS, max_wall_s: float = MAX_WALL_S) -> None:
        self.fleet = fleet
        self.policy = policy
        self.pool_high = pool_high
        self.queue_timeout_s = queue_timeout_s
        self.stall_s = stall_s
        self.lease_ms = lease_ms
        self.max_wall_s = max_wall_s
        self.gate = FifoGate()
        self._cursor = 0
        self._affinity: OrderedDict[str, str] = OrderedDict()
        fleet.on_capacity = self.gate.notify
        self.moves_total = 0

    @property
    def queued(self) -> int:
        return len(self.gate)

    # -- placement and queue ---------------------------------------------------------

    def _try_place(self, job: Job, prompt_len: int, max_tokens: int,
                   exclude: frozenset[str]) -> tuple[NodePool, NodeConn, str] | Refusal:
        req = PlacementRequest(model=job.model, prompt_tokens=prompt_len,
                               max_tokens=max_tokens, exclude=exclude,
                               affinity=self._affinity.get(job.affinity) if job.affinity else None,
                               pin_host=job.pin_host, prefer=job.prefer)
        now = time.monotonic()
        while True:
            decision = place(req, self.fleet.views(), now=now, policy=self.policy,
                             pool_high=self.pool_high, cursor=self._cursor)
            if isinstance(decision, Refusal):
                return decision
            assert isinstance(decision, Placement)
            self._cursor = decision.cursor
            pool = self.fleet.pools[decision.node]
            conn = pool.acquire()
            if conn is not None:
                return pool, conn, decision.reason
            # every idle connection was dead: the view is fresh now, place again
            req = PlacementRequest(model=req.model, prompt_tokens=req.prompt_tokens,
                                   max_tokens=req.max_tokens,
                                   exclude=req.exclude | {pool.key}, affinity=req.affinity,
                                   pin_host=req.pin_host, prefer=req.prefer)

    async def _acquire(self, job: Job, prompt_len: int, max_tokens: int,
                       exclude: frozenset[str], deadline: float
                       ) -> tuple[NodePool, NodeConn, str]:
        """A connection to the best node, waiting in FIFO order when every node is full."""
        fut: asyncio.Future[None] | None = None
        if not len(self.gate):
            got = self._try_place(job, prompt_len, max_tokens, exclude)
            if not isinstance(got, Refusal):
                return got
            self._raise_if_final(got)
        fut = self.gate.enqueue()
        try:
            last: Refusal | None = None
            while True:
                if self.gate.is_first(fut):
                    got = self._try_place(job, prompt_len, max_tokens, exclude)
                    if not isinstance(got, Refusal):
                        return got
                    self._raise_if_final(got)
                    last = got
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise self._timeout_error(last)
                # wake on any capacity change, and re-check at least twice a second
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(min(remaining, 0.5)):
                        await asyncio.shield(fut)
                if fut.done():
                    fut = self.gate.rearm(fut)
        finally:
            self.gate.leave(fut)

    def _raise_if_final(self, refusal: Refusal) -> None:
        if refusal.code == "context_length_exceeded":
            raise PlacementError(400, "context_length_exceeded", refusal.message)

    def _timeout_error(self, last: Refusal | None) -> PlacementError:
        if last is not None and last.code == "no_node":
            return PlacementError(503, "no_node_available", last.message, retry_after=10)
        waited = int(self.queue_timeout_s)
        return PlacementError(
            429, "fleet_busy",
            f"every lane of the fleet stayed busy for {waited} s; retry later or add a node",
            retry_after=max(1, waited // 4))

    # -- running -------------------------------------------------------------------

    async def run(self, job: Job) -> AsyncGenerator[list[int] | Finish, None]:
        """Yield batches of new token ids, then one Finish. Raises PlacementError."""
        started = time.monotonic()
        wall_deadline = started + self.max_wall_s
        delivered: list[int] = []
        exclude: frozenset[str] = frozenset()
        moves = 0
        prompt_tokens = len(job.prompt)
        cached = 0
        last_node = ""
        queue_deadline = started + self.queue_timeout_s
        while True:
            remaining = job.max_tokens - len(delivered)
            context = job.prompt + delivered
            pool, conn, reason = await self._acquire(job, len(context), remaining, exclude,
                                                     queue_deadline)
            if last_node:
                moves += 1
                self.moves_total += 1
                log.warning("session %s moved from %s to '%s' at %s after %d tokens (%s)",
                            job.session, last_node, pool.info.identity, pool.address,
                            len(delivered), reason)
            else:
                log.info("session %s placed on '%s' at %s (%s)", job.session,
                         pool.info.identity, pool.address, reason)
            last_node = f"'{pool.info.identity}'"
            if job.affinity:
                self._remember(job.affinity, pool.key)
            outcome = _Attempt(self, pool, conn, job, context, remaining, wall_deadline)
            try:
                async for item in outcome.stream():
                    if isinstance(item, list):
                        delivered.extend(item)
                        yield item
                    else:
                        cached = max(cached, item.cached_tokens) if not moves else cached
                        yield Finish(reason=item.finish_reason, prompt_tokens=prompt_tokens,
                                     completion_tokens=len(delivered), cached_tokens=cached,
                                     node=pool.info.identity, moves=moves)
                        return
            finally:
                outcome.release()
            if outcome.busy:
                # refused before any token of this attempt: try the next node at once
                pool.mark_full(time.monotonic())
                last_node = "" if not delivered and not moves else last_node
                queue_deadline = max(queue_deadline, time.monotonic())
                continue
            if outcome.wall_exceeded:
                log.warning("session %s reached the %d s ceiling; ending it", job.session,
                            int(self.max_wall_s))
                yield Finish(reason="length", prompt_tokens=prompt_tokens,
                             completion_tokens=len(delivered), cached_tokens=cached,
                             node=pool.info.identity, moves=moves)
                return
            # the node failed mid-session
            log.warning("session %s lost node '%s' at %s: %s", job.session,
                        pool.info.identity, pool.address, outcome.failure)
            exclude = exclude | {pool.key}
            if len(delivered) >= job.max_tokens:
                yield Finish(reason="length", prompt_tokens=prompt_tokens,
                             completion_tokens=len(delivered), cached_tokens=cached,
                             node=pool.info.identity, moves=moves)
                return
            queue_deadline = time.monotonic() + self.queue_timeout_s

    def _remember(self, session: str, key: str) -> None:
        self._affinity[session] = key
        self._affinity.move_to_end(session)
        while len(self._affinity) > _AFFINITY_MAX:
            self._affinity.popitem(last=False)


def _next_tokens(queue: asyncio.Queue[Inbound]) -> m.Tokens | None:
    """Take the next item if it is a token record already waiting, else None."""
    waiting = queue._queue  # type: ignore[attr-defined]  # asyncio.Queue's own deque
    if waiting and isinstance(waiting[0], m.Tokens):
        item: m.Tokens = queue.get_nowait()  # type: ignore[assignment]
        return item
    return None


class _Attempt:
    """One try of a session on one node."""

    def __init__(self, runner: SessionRunner, pool: NodePool, conn: NodeConn, job: Job,
                 context: list[int], max_tokens: int, wall_deadline: float) -> None:
        self.runner = runner
        self.pool = pool
        self.conn = conn
        self.job = job
        self.context = context
        self.max_tokens = max_tokens
        self.wall_deadline = wall_deadline
        self.busy = False
        self.failure = ""
        self.wall_exceeded = False
        self._finished = False  # Done seen: the connection is reusable
        self._released = False

    async def stream(self) -> AsyncGenerator[list[int] | m.Done, None]:
        job = self.job
        link = self.conn.link
        inbox = self.conn.inbox
        assert inbox is not None
        try:
            link.send(m.Generate(session=job.session, lease_ms=self.runner.lease_ms,
                                 prompt=self.context, max_tokens=self.max_tokens,
                                 sampling=job.sampling, stop_ids=job.stop_ids))
        except LinkClosed as exc:
            self.failure = str(exc)
            return
        # silence counts from now: an idle connection's last record may be old
        self.conn.last_rx = max(self.conn.last_rx, time.monotonic())
        lease_s = self.runner.lease_ms / 1000
        next_renew = time.monotonic() + lease_s / 3
        expected = 0
        nonce = 0
        accepted = False
        while True:
            now = time.monotonic()
            if now >= self.wall_deadline:
                self.wall_exceeded = True
                self._cancel()
                return
            silent_for = now - self.conn.last_rx
            if silent_for >= self.runner.stall_s:
                self.failure = (f"no tokens and no pong for {silent_for:.1f} s; "
                                "treating the node as hung")
                self.pool.mark_unresponsive(self.failure)
                return
            if now >= next_renew and accepted:
                with contextlib.suppress(LinkClosed):
                    link.send(m.Renew(session=job.session, lease_ms=self.runner.lease_ms))
                next_renew = now + lease_s / 3
            wait = min(PING_S, self.runner.stall_s - silent_for, next_renew - now,
                       self.wall_deadline - now)
            try:
                async with asyncio.timeout(max(wait, 0.01)):
                    rec = await inbox.get()
            except TimeoutError:
                if time.monotonic() - self.conn.last_rx >= PING_S:
                    nonce += 1
                    with contextlib.suppress(LinkClosed):
                        link.send(m.Ping(nonce=nonce))
                continue
            if isinstance(rec, ConnClosed):
                self.failure = f"connection lost ({rec.reason})"
                return
            if isinstance(rec, m.Accepted):
                accepted = True
            elif isinstance(rec, m.Tokens):
                ids: list[int] = []
                # when the head falls behind, relay every waiting token record as one
                # batch: one detokenize and one HTTP write instead of many
                tokens: m.Tokens | None = rec
                while tokens is not None:
                    if tokens.index != expected:
                        self.failure = f"token index {tokens.index} where {expected} was due"
                        self.conn.abort()
                        return
                    expected += len(tokens.ids)
                    ids.extend(tokens.ids)
                    tokens = _next_tokens(inbox)
                yield ids
            elif isinstance(rec, m.Done):
                self._finished = True
                yield rec
                return
            elif isinstance(rec, m.Error):
                if rec.code == "busy" and expected == 0:
                    self.busy = True
                    self._finished = True
                    log.info("node '%s' is full (%s); trying the next node",
                             self.pool.info.identity, rec.message)
                    return
                if rec.code == "context_length_exceeded":
                    self._finished = True
                    raise PlacementError(400, "context_length_exceeded", rec.message)
                self.failure = f"node error {rec.code}: {rec.message}"
                self._finished = True
                return

    def _cancel(self) -> None:
        with contextlib.suppress(LinkClosed):
            self.conn.link.send(m.Cancel(session=self.job.session))

    def release(self) -> None:
        """Give the connection back; one left mid-generation is cancelled and dropped."""
        if self._released:
            return
        self._released = True
        if not self._finished and not self.conn.closed and not self.failure:
            # the client went away or a stop string matched: stop the node's work
            self._cancel()
        self.pool.release(self.conn, reusable=self._finished)
